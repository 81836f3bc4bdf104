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


// A KV cache element type and how to widen it to float32. FP8 goes through a 256-entry table that
// already holds the layer's K or V scale. The attention kernels read the cache in place through a
// typed pointer (no widened copy), which lets their loops vectorize straight off the pages.
template <int KIND> struct CacheElem;
template <> struct CacheElem<kFloat32> {
    using T = float;
    static float get(const T* p, int i, const float*) { return p[i]; }
};
template <> struct CacheElem<kBFloat16> {
    using T = uint16_t;
    static float get(const T* p, int i, const float*) { return bf16_to_float(p[i]); }
};
template <> struct CacheElem<kFp8E4M3> {
    using T = uint8_t;
    static float get(const T* p, int i, const float* table) { return table[p[i]]; }
};

}  // namespace baton
