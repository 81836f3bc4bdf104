// Write new tokens' K and V rows into a float32 / bfloat16 paged cache at their slots, for CPU
// tensors (FP8 caches, which need quantizing, stay on kernels/kv_store.py's reference).
// A slot of -1 skips the token; the cache is contiguous [num_blocks, block_size, Hk, D], so
// slot s starts at element s * Hk * D.

#include <cstring>

#include "baton_cpu.h"

// Returns 0, or 2 when a slot is past the cache.
extern "C" int baton_store_kv(const char* key, int64_t k_stride_t, int64_t k_stride_h,
                              const char* value, int64_t v_stride_t, int64_t v_stride_h,
                              char* k_cache, char* v_cache, const int64_t* slots, int64_t T, int Hk, int D,
                              int64_t num_slots, int elem_size) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) return 2;
    const int64_t row = int64_t(D) * elem_size;
    for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        char* kd = k_cache + slot * Hk * row;
        char* vd = v_cache + slot * Hk * row;
        for (int h = 0; h < Hk; ++h) {
            std::memcpy(kd + h * row, key + (t * k_stride_t + h * k_stride_h) * elem_size, row);
            std::memcpy(vd + h * row, value + (t * v_stride_t + h * v_stride_h) * elem_size, row);
        }
    }
    return 0;
}
