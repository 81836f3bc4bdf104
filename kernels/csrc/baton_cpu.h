// Helpers shared by the native CPU kernels in this folder (see kernels/cpu_native.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace baton {

// Dtype codes passed from Python (kernels/cpu_native.py DTYPE_CODES).
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFp8E4M3 = 2 };

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);                   // round to nearest even, as torch does
    return uint16_t(bits >> 16);
}

// Typed access for templated kernels: the dtype is a compile-time constant, so loops over a row
// vectorize (a per-element dtype branch keeps them scalar).
template <int DT> struct Act;
template <> struct Act<kFloat32> {
    using T = float;
    static float load(const T* p, int64_t i) { return p[i]; }
    static void store(T* p, int64_t i, float v) { p[i] = v; }
    static float round(float v) { return v; }
};
template <> struct Act<kBFloat16> {
    using T = uint16_t;
    static float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
    static void store(T* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
    static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};


}  // namespace baton
