// Paged decode attention for CPU tensors: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), softmax in float32. Built at first use by kernels/cpu_native.py
// (plain C ABI, no torch headers, so it compiles quickly) and called through ctypes.
//
// Layout: q and out [B, Hq, D] with the given batch/head strides and unit stride over D;
// k_cache and v_cache contiguous [num_blocks, block_size, Hk, D]; block_tables [B, *] int32 with
// row stride bt_stride; context_lens [B] int32. One sequence per work item: each token's K/V row
// (all kv heads, contiguous) is read and widened once for every query head.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "baton_cpu.h"

namespace {

using namespace baton;

struct Args {
    const void* q; int64_t q_stride_b, q_stride_h; int q_dtype;
    const void* k_cache; const void* v_cache; int64_t num_blocks;
    const float* k_fp8_table; const float* v_fp8_table;
    const int32_t* block_tables; int64_t bt_stride, max_blocks_per_seq; const int32_t* context_lens;
    void* out; int64_t out_stride_b, out_stride_h;
    int64_t B; int Hq, Hk, D, block_size; float scale;
    int64_t window; float softcap;  // window 0: the whole context; softcap 0: no logit soft-capping
    int num_threads;
};

// Once a server has recycled its blocks a sequence's pages lie scattered in memory, and each page
// would start a fresh stream that the hardware prefetcher discovers late. So while token t is
// used, the same row of the next page is prefetched: one row per token spreads the prefetches
// evenly (a whole page at once was no faster). bench/decode_profile.py times decode steps with
// pages scattered and in order.
template <typename T>
inline void prefetch_row(const T* cache, int64_t row, int64_t row_len) {
    const char* p = reinterpret_cast<const char*>(cache + row * row_len);
    for (int64_t o = 0; o < row_len * int64_t(sizeof(T)); o += 64) __builtin_prefetch(p + o);
}

// DIM > 0 fixes the head dim at compile time (64 and 128 cover most models): the dot products then
// unroll into a few full-width vector FMAs with no remainder loop. DIM == 0 reads it from a.D.
template <int KV, int DIM>
void attend(const Args& a) {
    using T = typename CacheElem<KV>::T;
    const T* k_cache = static_cast<const T*>(a.k_cache);
    const T* v_cache = static_cast<const T*>(a.v_cache);
    const int G = a.Hq / a.Hk, D = DIM > 0 ? DIM : a.D, Hq = a.Hq;
    const int64_t row_len = int64_t(a.Hk) * D;  // one token's K (or V), every kv head: contiguous
    const int64_t max_ctx = a.max_blocks_per_seq * a.block_size;
    const int shift = __builtin_ctz(unsigned(a.block_size));
    const int64_t in_block = a.block_size - 1;
    auto first_row = [&](int64_t page) -> int64_t {
        return (page < 0 || page >= a.num_blocks ? 0 : page) << shift;  // garbage ids must not read out of bounds
    };

#pragma omp parallel num_threads(a.num_threads)
    {
        std::vector<float> qf(size_t(Hq) * D), acc(size_t(Hq) * D), scores, inv_sum(Hq);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < a.B; ++b) {
            int64_t ctx = a.context_lens[b];
            if (ctx > max_ctx) ctx = max_ctx;  // a bad length must not read past the block table
            // A sliding window sees the last `window` tokens only; earlier pages are never read.
            const int64_t lo = a.window > 0 && ctx > a.window ? ctx - a.window : 0, n_vis = ctx - lo;
            const int32_t* table = a.block_tables + b * a.bt_stride;
            for (int h = 0; h < Hq; ++h)
                load_scaled_query(a.q, a.q_dtype, b * a.q_stride_b + int64_t(h) * a.q_stride_h, a.scale,
                                  &qf[size_t(h) * D], D);
            scores.resize(size_t(Hq) * n_vis);

            // Offset of token t's row in `cache`, for t = 0, 1, ... in order (row0 follows the pages);
            // prefetches the same row of the next page. Tokens are walked with shifts and masks: a
            // division per token costs as much as its dot products.
            const int64_t num_pages = (ctx + in_block) >> shift;
            int64_t row0 = first_row(table[lo >> shift]);  // lo may sit inside a page
            auto token_offset = [&](const T* cache, int64_t t) -> int64_t {
                if ((t & in_block) == 0) row0 = first_row(table[t >> shift]);
                if ((t >> shift) + 1 < num_pages)
                    prefetch_row(cache, first_row(table[(t >> shift) + 1]) + (t & in_block), row_len);
                return (row0 + (t & in_block)) * row_len;
            };
            // Pass 1: scores[h][t] = q_h . k_t (query head h reads kv head h / G).
            for (int64_t t = lo; t < ctx; ++t) {
                const int64_t k_off = token_offset(k_cache, t);
                for (int h = 0; h < Hq; ++h) {
                    const float* qh = &qf[size_t(h) * D];
                    const T* kh = k_cache + k_off + int64_t(h / G) * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; ++d) s += qh[d] * CacheElem<KV>::get(kh, d, a.k_fp8_table);
                    scores[size_t(h) * n_vis + (t - lo)] = s;
                }
            }
            if (a.softcap > 0.0f) {  // Gemma 2: cap * tanh(s / cap), on the scaled scores
                const float inv_cap = 1.0f / a.softcap;
                for (size_t i = 0; i < size_t(Hq) * n_vis; ++i) scores[i] = a.softcap * std::tanh(scores[i] * inv_cap);
            }
            row0 = first_row(table[lo >> shift]);
            for (int h = 0; h < Hq; ++h) {
                const int64_t ctx = n_vis;  // the softmax runs over the visible tokens only
                float* sh = &scores[size_t(h) * ctx];
                float m = -INFINITY;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < ctx; ++t) m = sh[t] > m ? sh[t] : m;
                v16 vsum = {};
                int64_t t = 0;
                for (; t + 16 <= ctx; t += 16) {
                    const v16 e = exp_nonpositive(load(sh + t) - m);
                    store(sh + t, e);
                    vsum += e;
                }
                float sum = 0.0f;
                for (int c = 0; c < 16; ++c) sum += vsum[c];
                for (; t < ctx; ++t) {
                    sh[t] = std::exp(sh[t] - m);
                    sum += sh[t];
                }
                inv_sum[h] = 1.0f / sum;  // sum >= 1: the maximum contributes exp(0)
            }
            // Pass 2: out_h = sum_t p[h][t] v_t / sum
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t t = lo; t < ctx; ++t) {
                const int64_t v_off = token_offset(v_cache, t);
                for (int h = 0; h < Hq; ++h) {
                    const float p = scores[size_t(h) * n_vis + (t - lo)];
                    const T* vh = v_cache + v_off + int64_t(h / G) * D;
                    float* ah = &acc[size_t(h) * D];
#pragma omp simd
                    for (int d = 0; d < D; ++d) ah[d] += p * CacheElem<KV>::get(vh, d, a.v_fp8_table);
                }
            }
            for (int h = 0; h < Hq; ++h) {
                const float* ah = &acc[size_t(h) * D];
                const int64_t base = b * a.out_stride_b + int64_t(h) * a.out_stride_h;
                if (a.q_dtype == kFloat32) {
                    float* o = static_cast<float*>(a.out) + base;
                    for (int d = 0; d < D; ++d) o[d] = ah[d] * inv_sum[h];
                } else {
                    uint16_t* o = static_cast<uint16_t*>(a.out) + base;
                    for (int d = 0; d < D; ++d) o[d] = float_to_bf16(ah[d] * inv_sum[h]);
                }
            }
        }
    }
}

template <int KV>
void dispatch_dim(const Args& a) {
    if (a.D == 64) attend<KV, 64>(a);
    else if (a.D == 128) attend<KV, 128>(a);
    else attend<KV, 0>(a);
}

}  // namespace

// Returns 0, or 1 for bad geometry / dtype, 2 for a context length below 1.
extern "C" int baton_paged_decode_attention(
    const void* q, int64_t q_stride_b, int64_t q_stride_h, int q_dtype,
    const void* k_cache, const void* v_cache, int kv_dtype, int64_t num_blocks,
    const float* k_fp8_table, const float* v_fp8_table,
    const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks_per_seq, const int32_t* context_lens,
    void* out, int64_t out_stride_b, int64_t out_stride_h,
    int64_t B, int Hq, int Hk, int D, int block_size,
    float scale, int64_t window, float softcap, int num_threads) {
    if (Hk <= 0 || Hq % Hk != 0 || D <= 0 || block_size <= 0 || (block_size & (block_size - 1)) != 0) return 1;
    if (q_dtype != kFloat32 && q_dtype != kBFloat16) return 1;
    for (int64_t b = 0; b < B; ++b)
        if (context_lens[b] < 1) return 2;
    const Args a{q, q_stride_b, q_stride_h, q_dtype, k_cache, v_cache, num_blocks, k_fp8_table, v_fp8_table,
                 block_tables, bt_stride, max_blocks_per_seq, context_lens, out, out_stride_b, out_stride_h,
                 B, Hq, Hk, D, block_size, scale, window, softcap, num_threads};
    switch (kv_dtype) {
        case kFloat32: dispatch_dim<kFloat32>(a); return 0;
        case kBFloat16: dispatch_dim<kBFloat16>(a); return 0;
        case kFp8E4M3: dispatch_dim<kFp8E4M3>(a); return 0;
        default: return 1;
    }
}
