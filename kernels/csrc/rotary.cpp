// Rotary position embedding (NeoX / HF-Llama rotate_half style) in place on q and k, for CPU tensors.
// cos_sin_cache is float32 [max_position, head_dim] = cat(cos, sin); the rotation is computed in
// float32 and rounded once to the activation dtype, as kernels/rotary.py's reference does.

#include "baton_cpu.h"

using namespace baton;

namespace {

template <int DT>
void rotate_all(const int64_t* positions, void* q_, int64_t q_stride_t, int64_t q_stride_h, int Hq, void* k_,
                int64_t k_stride_t, int64_t k_stride_h, int Hk, int D, const float* cos_sin, int64_t T,
                int num_threads) {
    using A = Act<DT>;
    auto* q = static_cast<typename A::T*>(q_);
    auto* k = static_cast<typename A::T*>(k_);
    const int half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float* cos = cos_sin + positions[t] * D;
        const float* sin = cos + half;
        for (int h = 0; h < Hq + Hk; ++h) {
            auto* x = h < Hq ? q + t * q_stride_t + h * q_stride_h : k + t * k_stride_t + (h - Hq) * k_stride_h;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float x1 = A::load(x, i), x2 = A::load(x, half + i);
                A::store(x, i, x1 * cos[i] - x2 * sin[i]);
                A::store(x, half + i, x2 * cos[i] + x1 * sin[i]);
            }
        }
    }
}

}  // namespace

// Returns 0, 1 for an unsupported dtype, or 2 when a position is outside the cache.
extern "C" int baton_rotary(const int64_t* positions, void* q, int64_t q_stride_t, int64_t q_stride_h, int Hq,
                            void* k, int64_t k_stride_t, int64_t k_stride_h, int Hk, int D,
                            const float* cos_sin, int64_t max_position, int64_t T, int dtype, int num_threads) {
    for (int64_t t = 0; t < T; ++t)
        if (positions[t] < 0 || positions[t] >= max_position) return 2;
    if (dtype == kFloat32)
        rotate_all<kFloat32>(positions, q, q_stride_t, q_stride_h, Hq, k, k_stride_t, k_stride_h, Hk, D, cos_sin, T, num_threads);
    else if (dtype == kBFloat16)
        rotate_all<kBFloat16>(positions, q, q_stride_t, q_stride_h, Hq, k, k_stride_t, k_stride_h, Hk, D, cos_sin, T, num_threads);
    else
        return 1;
    return 0;
}
