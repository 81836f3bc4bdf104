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

// out[d] = q[offset + d] * scale for a float32 or bfloat16 query row (both attention kernels work
// on scaled float32 copies of their queries).
inline void load_scaled_query(const void* q, int q_dtype, int64_t offset, float scale, float* out, int n) {
    if (q_dtype == kFloat32) {
        const float* src = static_cast<const float*>(q) + offset;
        for (int d = 0; d < n; ++d) out[d] = src[d] * scale;
    } else {
        const uint16_t* src = static_cast<const uint16_t*>(q) + offset;
        for (int d = 0; d < n; ++d) out[d] = bf16_to_float(src[d]) * scale;
    }
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

// 16 float32 lanes: one page of 16 tokens, or 16 elements of a row. GCC/Clang vector extensions
// lower this to whatever the target has (one AVX-512 register, two AVX2 ones, ...).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // for unaligned rows
typedef int32_t v16i __attribute__((vector_size(64)));

// exp(x) for x <= 0 (scores minus their running max), 16 lanes at once: 2^(x log2 e) split into
// 2^n (exponent bits) times a degree-6 polynomial for 2^f, |f| <= 0.5 (relative error ~2e-7).
// Written out because std::exp in a loop stays a scalar libm call (measured: SiLU-and-mul and the
// decode softmax spent most of their time in expf).
inline v16 exp_nonpositive(v16 x) {
    v16 y = x * 1.4426950408889634f;
    y = y < -127.0f ? v16{} - 127.0f : y;                 // also maps -inf; 2^-127 underflows to 0 below
    const v16i n = __builtin_convertvector(y - 0.5f, v16i);  // y <= 0: truncation rounds to nearest
    const v16 f = y - __builtin_convertvector(n, v16);
    v16 p = f * 1.5403530e-4f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const v16i bits = (n + 127) << 23;  // n = -127 gives exponent 0: the result is 0
    v16 scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Horizontal max and sum of 16 lanes: four shuffle-and-combine steps instead of a 16-long chain.
inline float reduce_max(v16 v) {
    v16 t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v > t ? v : t;
    t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v > t ? v : t;
    t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = v > t ? v : t;
    t = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    v = v > t ? v : t;
    return v[0];
}

inline float reduce_add(v16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16w __attribute__((vector_size(64)));

// 16 bfloat16 values to float32 and back, rounding as float_to_bf16 does (nearest even, NaN kept).
inline v16 load(const uint16_t* p) {
    const v16w bits = __builtin_convertvector(*reinterpret_cast<const v16h*>(p), v16w) << 16;
    v16 f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store(uint16_t* p, v16 v) {
    v16w bits;
    __builtin_memcpy(&bits, &v, sizeof bits);
    const v16w rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const v16w nan = v16w{} + 0x7fc0u;
    *reinterpret_cast<v16h*>(p) = __builtin_convertvector((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded, v16h);
}

}  // namespace baton
