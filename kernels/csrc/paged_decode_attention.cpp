// Paged decode attention for CPU tensors: one query token per sequence, K/V read in place from the
// paged cache (no gather copy), softmax in float32. Built at first use by kernels/cpu_native.py
// (plain C ABI, no torch headers, so it compiles quickly) and called through ctypes.
//
// Layout: q and out [B, Hq, D] with the given batch/head strides and unit stride over D;
// k_cache and v_cache contiguous [num_blocks, block_size, Hk, D]; block_tables [B, *] int32 with
// row stride bt_stride; context_lens [B] int32. One sequence per work item. With a head dim of 64
// or 128 each kv head's slice of the pages is walked once per block of its query heads, whose
// queries (pass 1) or sums (pass 2) stay in registers; a step of 16 sequences of the default model
// then spent 19.9 ms in attention where a loop over all heads per token spent 23.2
// (bench/decode_profile.py, float32, one thread), the rest of it reading memory. Other head dims
// read each token's row (all kv heads, contiguous) once for every query head.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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
inline void prefetch(const T* start, int64_t n) {
    const char* p = reinterpret_cast<const char*>(start);
    for (int64_t o = 0; o < n * int64_t(sizeof(T)); o += 64) __builtin_prefetch(p + o);
}

// The first cache row of block `id` (block_size = 1 << shift); garbage ids must not read out of bounds.
inline int64_t block_first_row(int64_t id, int64_t num_blocks, int shift) {
    return (id < 0 || id >= num_blocks ? 0 : id) << shift;
}

// 16 cache elements widened to float32 lanes.
template <int KV>
inline v16 load_elems(const typename CacheElem<KV>::T* p, const float* table) {
    if constexpr (KV == kFp8E4M3) {
        v16 r;
        for (int i = 0; i < 16; ++i) r[i] = table[p[i]];
        return r;
    } else {
        return load(p);
    }
}

// Tokens lo..ctx-1 of one sequence, the slice of kv head g in each token's row: the page lookup and
// the prefetch of the same slice in the next page (see prefetch).
template <typename T>
struct HeadWalk {
    const T* cache; const int32_t* table; int64_t num_blocks, row_len, head_off, num_pages; int shift, head_len;
    const T* row(int64_t t) const {
        const int64_t page = t >> shift, in_page = t & ((int64_t(1) << shift) - 1);
        if (page + 1 < num_pages) prefetch(slice(page + 1, in_page), head_len);
        return slice(page, in_page);
    }
    const T* slice(int64_t page, int64_t in_page) const {
        return cache + (block_first_row(table[page], num_blocks, shift) + in_page) * row_len + head_off;
    }
};

// Sums of 16 vectors at once, r[i] = sum of a[kBitReversed[i]]'s lanes: four rounds of shuffles
// and adds that halve the lanes per vector (45 operations against 16 horizontal sums' 128).
// The rounds leave the sums in bit-reversed order, so callers put vector i at a[kBitReversed[i]].
constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline v16 sum_each(const v16* a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// The query heads h0..h0+NH-1 of one kv head against its keys: scores[h][t - lo] = q_h . k_t. The
// queries stay in registers, each key slice is loaded once for all NH heads, and the products of
// 16 tokens are summed together (sum_each).
template <int KV, int DV, int NH>
void head_scores(const HeadWalk<typename CacheElem<KV>::T>& walk, const float* k_table, const float* qf,
                 float* scores, int64_t n_vis, int64_t lo, int64_t ctx) {
    v16 q[NH][DV];
    for (int h = 0; h < NH; ++h)
        for (int j = 0; j < DV; ++j) q[h][j] = load(qf + (h * DV + j) * 16);
    auto products = [&](int64_t t, v16* s) {
        const auto* kr = walk.row(t);
        v16 k[DV];
        for (int j = 0; j < DV; ++j) k[j] = load_elems<KV>(kr + j * 16, k_table);
        for (int h = 0; h < NH; ++h) {
            s[h] = q[h][0] * k[0];
            for (int j = 1; j < DV; ++j) s[h] += q[h][j] * k[j];
        }
    };
    v16 tile[NH][16];
    int64_t t = lo;
    for (; t + 16 <= ctx; t += 16) {
        for (int i = 0; i < 16; ++i) {
            v16 s[NH];
            products(t + i, s);
            for (int h = 0; h < NH; ++h) tile[h][kBitReversed[i]] = s[h];
        }
        for (int h = 0; h < NH; ++h) store(scores + h * n_vis + (t - lo), sum_each(tile[h]));
    }
    for (; t < ctx; ++t) {
        v16 s[NH];
        products(t, s);
        for (int h = 0; h < NH; ++h) scores[h * n_vis + (t - lo)] = reduce_add(s[h]);
    }
}

// out_h = sum_t p[h][t] v_t, for the same NH query heads, the sums in registers.
template <int KV, int DV, int NH>
void head_values(const HeadWalk<typename CacheElem<KV>::T>& walk, const float* v_table, const float* probs,
                 float* acc_out, int64_t n_vis, int64_t lo, int64_t ctx) {
    v16 acc[NH][DV] = {};
    for (int64_t t = lo; t < ctx; ++t) {
        const auto* vr = walk.row(t);
        v16 v[DV];
        for (int j = 0; j < DV; ++j) v[j] = load_elems<KV>(vr + j * 16, v_table);
        for (int h = 0; h < NH; ++h) {
            const v16 p = v16{} + probs[h * n_vis + (t - lo)];
            for (int j = 0; j < DV; ++j) acc[h][j] += p * v[j];
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int j = 0; j < DV; ++j) store(acc_out + (h * DV + j) * 16, acc[h][j]);
}

// Query heads per register block: NH x DV query (or sum) vectors plus DV key vectors fit the 32
// registers of AVX-512 with room to spare.
template <int DIM> constexpr int kHeadBlock = DIM == 64 ? 4 : 2;

// Calls body(std::integral_constant<int, NH>, g, h0) over the query heads of every kv head g in
// blocks h0..h0+NH-1 of up to kHeadBlock<DIM>, so that NH is a compile-time constant.
template <int DIM, typename Body>
void for_head_blocks(int Hk, int G, Body&& body) {
    constexpr int HB = kHeadBlock<DIM>;
    for (int g = 0; g < Hk; ++g)
        for (int h0 = g * G; h0 < (g + 1) * G; h0 += HB) {
            const int nh = (g + 1) * G - h0 < HB ? (g + 1) * G - h0 : HB;
            if (nh == HB) body(std::integral_constant<int, HB>{}, g, h0);
            else if (nh == 3) body(std::integral_constant<int, (HB >= 3 ? 3 : 1)>{}, g, h0);
            else if (nh == 2) body(std::integral_constant<int, (HB >= 2 ? 2 : 1)>{}, g, h0);
            else body(std::integral_constant<int, 1>{}, g, h0);
        }
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
    auto first_row = [&](int64_t id) { return block_first_row(id, a.num_blocks, shift); };

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
                    prefetch(cache + (first_row(table[(t >> shift) + 1]) + (t & in_block)) * row_len, row_len);
                return (row0 + (t & in_block)) * row_len;
            };
            // Head dims 64 and 128: kv head g's slice of every token's row in `cache`.
            auto head_walk = [&](const T* cache, int g) {
                return HeadWalk<T>{cache, table, a.num_blocks, row_len, int64_t(g) * D, num_pages, shift, D};
            };
            // Pass 1: scores[h][t] = q_h . k_t (query head h reads kv head h / G).
            if constexpr (DIM > 0) {
                for_head_blocks<DIM>(a.Hk, G, [&](auto nh, int g, int h0) {
                    head_scores<KV, DIM / 16, decltype(nh)::value>(head_walk(k_cache, g), a.k_fp8_table,
                                                                   &qf[size_t(h0) * D], &scores[size_t(h0) * n_vis],
                                                                   n_vis, lo, ctx);
                });
            } else {
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
            if constexpr (DIM > 0) {
                for_head_blocks<DIM>(a.Hk, G, [&](auto nh, int g, int h0) {
                    head_values<KV, DIM / 16, decltype(nh)::value>(head_walk(v_cache, g), a.v_fp8_table,
                                                                   &scores[size_t(h0) * n_vis], &acc[size_t(h0) * D],
                                                                   n_vis, lo, ctx);
                });
            } else {
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
