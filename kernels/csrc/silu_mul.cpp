// SiLU-and-mul for CPU tensors: out[t, i] = silu(x[t, i]) * x[t, inter + i], x = [gate | up].
// Computed in float32 and rounded once to the activation dtype, as kernels/silu_mul.py's reference.

#include <cmath>

#include "baton_cpu.h"

using namespace baton;

namespace {

template <int DT>
void silu_mul_rows(const void* x_, int64_t x_stride, void* out_, int64_t out_stride, int64_t T, int64_t inter,
                   int num_threads) {
    using A = Act<DT>;
    const auto* x = static_cast<const typename A::T*>(x_);
    auto* out = static_cast<typename A::T*>(out_);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const auto* gate = x + t * x_stride;
        const auto* up = gate + inter;
        auto* o = out + t * out_stride;
        int64_t i = 0;
        // sigmoid(g) from e = exp(-|g|) <= 1, which cannot overflow: 1 / (1 + e) for g >= 0,
        // e / (1 + e) below.
        for (; i + 16 <= inter; i += 16) {
            const v16 g = load(gate + i);
            const v16 e = exp_nonpositive(g < 0.0f ? g : -g);
            const v16 r = 1.0f / (1.0f + e);
            store(o + i, g * (g < 0.0f ? e * r : r) * load(up + i));
        }
        for (; i < inter; ++i) {
            const float g = A::load(gate, i);
            A::store(o, i, g / (1.0f + std::exp(-g)) * A::load(up, i));
        }
    }
}

}  // namespace

extern "C" int baton_silu_and_mul(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t T,
                                  int64_t inter, int dtype, int num_threads) {
    if (dtype == kFloat32) silu_mul_rows<kFloat32>(x, x_stride, out, out_stride, T, inter, num_threads);
    else if (dtype == kBFloat16) silu_mul_rows<kBFloat16>(x, x_stride, out, out_stride, T, inter, num_threads);
    else return 1;
    return 0;
}
