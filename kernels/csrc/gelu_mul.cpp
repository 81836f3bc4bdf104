// GeGLU for CPU tensors (Gemma): out[t, i] = gelu_tanh(x[t, i]) * x[t, inter + i], x = [gate | up],
// gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))) (transformers' gelu_pytorch_tanh).
// Computed in float32 and rounded once to the activation dtype, as kernels/gelu_mul.py's reference.

#include <cmath>

#include "baton_cpu.h"

using namespace baton;

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;

template <int DT>
void gelu_mul_rows(const void* x_, int64_t x_stride, void* out_, int64_t out_stride, int64_t T, int64_t inter,
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
        // tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2 |y|) <= 1, which cannot overflow.
        for (; i + 16 <= inter; i += 16) {
            const v16 g = load(gate + i);
            const v16 y = kSqrt2OverPi * (g + 0.044715f * g * g * g);
            const v16 e = exp_nonpositive(-2.0f * (y < 0.0f ? -y : y));
            const v16 th = (1.0f - e) / (1.0f + e);
            store(o + i, 0.5f * g * (1.0f + (y < 0.0f ? -th : th)) * load(up + i));
        }
        for (; i < inter; ++i) {
            const float g = A::load(gate, i);
            A::store(o, i, 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * A::load(up, i));
        }
    }
}

}  // namespace

extern "C" int baton_gelu_tanh_and_mul(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t T,
                                       int64_t inter, int dtype, int num_threads) {
    if (dtype == kFloat32) gelu_mul_rows<kFloat32>(x, x_stride, out, out_stride, T, inter, num_threads);
    else if (dtype == kBFloat16) gelu_mul_rows<kBFloat16>(x, x_stride, out, out_stride, T, inter, num_threads);
    else return 1;
    return 0;
}
