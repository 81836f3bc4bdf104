// RMSNorm over the last dim, optionally fused with the residual add before it, for CPU tensors.
// Same arithmetic as kernels/rms_norm.py's reference: the sum x + residual is rounded to the
// activation dtype first (it is the residual stream returned), then normalised in float32 and
// multiplied by the weight, rounding once on the way out.

#include <cmath>

#include "baton_cpu.h"

using namespace baton;

namespace {

template <int DT, int WT>
void norm_rows(const void* x_, int64_t x_stride, const void* r_, int64_t r_stride, const void* w_, void* out_,
               int64_t out_stride, void* sum_, int64_t sum_stride, int64_t T, int64_t H, float eps, int num_threads) {
    using A = Act<DT>;
    using W = Act<WT>;
    const auto* x = static_cast<const typename A::T*>(x_);
    const auto* r = static_cast<const typename A::T*>(r_);
    const auto* w = static_cast<const typename W::T*>(w_);
    auto* out = static_cast<typename A::T*>(out_);
    auto* sum = static_cast<typename A::T*>(sum_);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float s[8192];  // one row; hidden sizes past 8192 are rejected by the Python wrapper
        const auto* xt = x + t * x_stride;
        if (r) {
            const auto* rt = r + t * r_stride;
            auto* st = sum + t * sum_stride;
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) {
                s[i] = A::round(A::load(xt, i) + A::load(rt, i));
                A::store(st, i, s[i]);
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < H; ++i) s[i] = A::load(xt, i);
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < H; ++i) sq += s[i] * s[i];
        const float inv = 1.0f / std::sqrt(sq / float(H) + eps);
        auto* ot = out + t * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) A::store(ot, i, (s[i] * inv) * W::load(w, i));
    }
}

}  // namespace

extern "C" int baton_rms_norm(const void* x, int64_t x_stride, const void* residual, int64_t r_stride,
                              const void* weight, int w_dtype, void* out, int64_t out_stride,
                              void* sum_out, int64_t sum_stride, int64_t T, int64_t H, float eps, int dtype,
                              int num_threads) {
    if (H <= 0 || H > 8192) return 1;
    auto run = [&](auto norm) {
        norm(x, x_stride, residual, r_stride, weight, out, out_stride, sum_out, sum_stride, T, H, eps, num_threads);
        return 0;
    };
    switch (dtype * 2 + w_dtype) {
        case kFloat32 * 2 + kFloat32: return run(norm_rows<kFloat32, kFloat32>);
        case kFloat32 * 2 + kBFloat16: return run(norm_rows<kFloat32, kBFloat16>);
        case kBFloat16 * 2 + kFloat32: return run(norm_rows<kBFloat16, kFloat32>);
        case kBFloat16 * 2 + kBFloat16: return run(norm_rows<kBFloat16, kBFloat16>);
        default: return 1;
    }
}
