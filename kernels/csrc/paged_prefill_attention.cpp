// Paged prefill attention for CPU tensors: each sequence's new query tokens attend causally to its
// whole context, K/V read in place from the pages. Flash-attention style: one work item is a
// block of up to kQueryBlock queries of one sequence and all query heads of one kv head; it walks
// the context 64 tokens (four pages) at a time with an online softmax in float32.
//
// Per tile of four pages, K is widened and transposed to kt[d][token] so the scores of a group of
// query rows at a time accumulate as whole-page vectors (independent FMA chains), and
// V is widened to v[token][d] so each row's output accumulates as head-dim vectors. A page's K/V
// is thus converted once and reused by every query row of the block (G heads x up to 64 queries).
//
// Layout: q and out [T, Hq, D] (strides given, unit stride over D); caches contiguous
// [num_blocks, block_size, Hk, D]; block_tables [B, *] int32; query_start_loc [B + 1] int32;
// context_lens [B] int32 counts each sequence's tokens including its new ones.

#include <cmath>
#include <vector>

#include "baton_cpu.h"

using namespace baton;

namespace {

constexpr int kQueryBlock = 64;

struct Args {
    const void* q; int64_t q_stride_t, q_stride_h; int q_dtype;
    const void* k_cache; const void* v_cache; int64_t num_blocks;
    const float* k_fp8_table; const float* v_fp8_table;
    const int32_t* block_tables; int64_t bt_stride, max_blocks_per_seq;
    const int32_t* query_start_loc; const int32_t* context_lens;
    void* out; int64_t out_stride_t, out_stride_h;
    int64_t B; int Hq, Hk, D; float scale;
    int64_t window; float softcap;  // window 0: causal over the whole context; softcap 0: none
    int num_threads;
};

constexpr int BS = 16;             // tokens per page this kernel is written for
constexpr int TP = 4;              // pages per tile: softmax bookkeeping is paid once per 64 tokens
constexpr int TILE = BS * TP;
constexpr int TV = TILE / 16;      // vectors per tile row

// DIM: head dim (compile-time so the tile loops unroll into whole vectors).
template <int KVK, int DIM>
void attend(const Args& a, const std::vector<int64_t>& items) {
    using Elem = CacheElem<KVK>;
    using T = typename Elem::T;
    constexpr int NV = DIM / 16;  // vectors per head row
    // Query rows sharing each K/V vector load: their score (TV each) and output (NV each)
    // accumulators plus the loaded vectors fill the 32 vector registers without spilling.
    constexpr int kRowGroup = DIM <= 64 ? 6 : 3;
    const T* k_cache = static_cast<const T*>(a.k_cache);
    const T* v_cache = static_cast<const T*>(a.v_cache);
    const int G = a.Hq / a.Hk;
    const int64_t row_len = int64_t(a.Hk) * DIM;
    const int64_t n_items = int64_t(items.size());

#pragma omp parallel num_threads(a.num_threads)
    {
        const int max_rows = (G * kQueryBlock + kRowGroup - 1) / kRowGroup * kRowGroup;
        std::vector<float> qf(size_t(max_rows) * DIM), acc(size_t(max_rows) * DIM), m(max_rows), l(max_rows);
        std::vector<int64_t> qpos(max_rows);
        alignas(64) float kt[DIM][TILE];
        alignas(64) float vt[TILE][DIM];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; ++it) {
            // items[it] packs (sequence, kv head, first query of the block).
            const int64_t b = items[it] >> 40, h = (items[it] >> 24) & 0xffff, q0 = items[it] & 0xffffff;
            const int64_t start = a.query_start_loc[b], q_len = a.query_start_loc[b + 1] - start;
            const int64_t ctx = a.context_lens[b], prefix = ctx - q_len;
            const int nq = int(q_len - q0 < kQueryBlock ? q_len - q0 : kQueryBlock);
            const int rows = G * nq, padded = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
            for (int r = 0; r < padded; ++r) {
                float* qr = &qf[size_t(r) * DIM];
                m[r] = -INFINITY;
                l[r] = 0.0f;
                for (int d = 0; d < DIM; ++d) acc[size_t(r) * DIM + d] = 0.0f;
                if (r >= rows) {  // padding rows: zero queries at position -1 see nothing
                    for (int d = 0; d < DIM; ++d) qr[d] = 0.0f;
                    qpos[r] = -1;
                    continue;
                }
                const int g = r / nq, j = r % nq;
                const int64_t tok = start + q0 + j;
                load_scaled_query(a.q, a.q_dtype, tok * a.q_stride_t + (h * G + g) * a.q_stride_h, a.scale, qr, DIM);
                qpos[r] = prefix + q0 + j;
            }
            const int64_t last = prefix + q0 + nq - 1;  // the block's last query position
            const int32_t* table = a.block_tables + b * a.bt_stride;
            // With a sliding window the walk starts at the page of the block's first visible key:
            // earlier pages (possibly freed and reused) are never read.
            int64_t first_key = 0;
            if (a.window > 0 && prefix + q0 - a.window + 1 > 0) first_key = (prefix + q0 - a.window + 1) / BS * BS;
            for (int64_t t0 = first_key; t0 <= last; t0 += TILE) {
                const int n = int(last + 1 - t0 < TILE ? last + 1 - t0 : TILE);
                for (int c = 0; c < TILE; ++c) {
                    if (c < n) {
                        int64_t page = table[(t0 + c) / BS];
                        if (page < 0 || page >= a.num_blocks) page = 0;  // garbage ids must not read out of bounds
                        const int64_t off = ((page * BS + (t0 + c) % BS) * row_len) + h * DIM;
                        const T* kr = k_cache + off;
                        const T* vr = v_cache + off;
                        for (int d = 0; d < DIM; ++d) {
                            kt[d][c] = Elem::get(kr, d, a.k_fp8_table);
                            vt[c][d] = Elem::get(vr, d, a.v_fp8_table);
                        }
                    } else {
                        for (int d = 0; d < DIM; ++d) kt[d][c] = vt[c][d] = 0.0f;
                    }
                }
                for (int r0 = 0; r0 < padded; r0 += kRowGroup) {
                    // Scores of the group's rows over the tile: kRowGroup x TV independent FMA chains.
                    v16 s[kRowGroup][TV] = {};
                    const float* q = &qf[size_t(r0) * DIM];
                    for (int d = 0; d < DIM; ++d) {
                        v16 k[TV];
                        for (int i = 0; i < TV; ++i) k[i] = load(&kt[d][16 * i]);
                        for (int rr = 0; rr < kRowGroup; ++rr) {
                            const float qd = q[rr * DIM + d];
                            for (int i = 0; i < TV; ++i) s[rr][i] += qd * k[i];
                        }
                    }
                    alignas(64) float p[kRowGroup][TILE];
                    // Softmax bookkeeping for the group's rows at once: horizontal max and sum by
                    // shuffle trees, and one vector exp for all their rescale factors (scalar
                    // reductions and a libm exp per row cost as much as a third of the FMAs).
                    float tile_max[kRowGroup];
                    bool live[kRowGroup];
                    if (a.softcap > 0.0f) {  // Gemma 2: cap * tanh(s / cap) on the scaled scores
                        const float inv_cap = 1.0f / a.softcap;
                        for (int rr = 0; rr < kRowGroup; ++rr)
                            for (int i = 0; i < TV; ++i)
                                for (int c = 0; c < 16; ++c) s[rr][i][c] = a.softcap * std::tanh(s[rr][i][c] * inv_cap);
                    }
                    for (int rr = 0; rr < kRowGroup; ++rr) {
                        const int r = r0 + rr;
                        const int64_t visible = qpos[r] - t0 + 1;  // tokens of this tile the row may see
                        const int vis = visible <= 0 ? 0 : int(visible < n ? visible : n);
                        // The first lane inside the row's window (0 without a window).
                        const int64_t from = a.window > 0 ? qpos[r] - a.window + 1 - t0 : 0;
                        const int lo = from <= 0 ? 0 : int(from < TILE ? from : TILE);
                        live[rr] = vis > lo;
                        if (!live[rr]) {  // fully masked (or padding): nothing changes for this row
                            tile_max[rr] = -INFINITY;
                            continue;
                        }
                        if (vis < TILE || lo > 0) {
                            // Mask the scores past the row's position (the diagonal tile), and before
                            // its window, lane-wise.
                            for (int i = 0; i < TV; ++i) {
                                const v16i lane = v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + 16 * i;
                                s[rr][i] = (lane < vis) & (lane >= lo) ? s[rr][i] : v16{} - INFINITY;
                            }
                        }
                        v16 vmax = s[rr][0];
                        for (int i = 1; i < TV; ++i) vmax = s[rr][i] > vmax ? s[rr][i] : vmax;
                        tile_max[rr] = reduce_max(vmax);
                    }
                    v16 old_m = {}, new_m = {};
                    for (int rr = 0; rr < kRowGroup; ++rr) {
                        const float m_old = m[r0 + rr];
                        const float m_new = live[rr] && tile_max[rr] > m_old ? tile_max[rr] : m_old;
                        old_m[rr] = m_old;
                        new_m[rr] = m_new;
                    }
                    // exp(m_old - m_new) <= 1: exactly 1 when the max did not move, 0 on a row's
                    // first tile (m_old = -inf); lanes past the group's rows are unused.
                    const v16 alphas = exp_nonpositive(old_m == new_m ? v16{} : old_m - new_m);
                    float alpha[kRowGroup];
                    for (int rr = 0; rr < kRowGroup; ++rr) {
                        const int r = r0 + rr;
                        alpha[rr] = live[rr] ? alphas[rr] : 1.0f;
                        if (!live[rr]) {
                            for (int c = 0; c < TILE; ++c) p[rr][c] = 0.0f;
                            continue;
                        }
                        const v16 mn = v16{} + new_m[rr];
                        v16 vsum = {};
                        for (int i = 0; i < TV; ++i) {
                            const v16 e = exp_nonpositive(s[rr][i] - mn);
                            store(&p[rr][16 * i], e);
                            vsum += e;
                        }
                        l[r] = l[r] * alpha[rr] + reduce_add(vsum);
                        m[r] = new_m[rr];
                    }
                    // Output of the group's rows: kRowGroup x NV accumulators held in registers across the tile.
                    v16 o[kRowGroup][NV];
                    for (int rr = 0; rr < kRowGroup; ++rr)
                        for (int i = 0; i < NV; ++i) o[rr][i] = load(&acc[size_t(r0 + rr) * DIM + 16 * i]) * alpha[rr];
                    for (int c = 0; c < n; ++c) {
                        v16 v[NV];
                        for (int i = 0; i < NV; ++i) v[i] = load(&vt[c][16 * i]);
                        for (int rr = 0; rr < kRowGroup; ++rr) {
                            const float pc = p[rr][c];
                            for (int i = 0; i < NV; ++i) o[rr][i] += pc * v[i];
                        }
                    }
                    for (int rr = 0; rr < kRowGroup; ++rr)
                        for (int i = 0; i < NV; ++i) store(&acc[size_t(r0 + rr) * DIM + 16 * i], o[rr][i]);
                }
            }
            for (int r = 0; r < rows; ++r) {
                const int g = r / nq, j = r % nq;
                const int64_t tok = start + q0 + j;
                const int64_t base = tok * a.out_stride_t + (h * G + g) * a.out_stride_h;
                const float inv = 1.0f / l[r];  // l >= 1: every query sees at least itself
                const float* ar = &acc[size_t(r) * DIM];
                if (a.q_dtype == kFloat32) {
                    float* o = static_cast<float*>(a.out) + base;
                    for (int d = 0; d < DIM; ++d) o[d] = ar[d] * inv;
                } else {
                    uint16_t* o = static_cast<uint16_t*>(a.out) + base;
                    for (int d = 0; d < DIM; ++d) o[d] = float_to_bf16(ar[d] * inv);
                }
            }
        }
    }
}

template <int KVK>
int dispatch(const Args& a, int block_size, const std::vector<int64_t>& items) {
    if (block_size == BS && a.D == 64) attend<KVK, 64>(a, items);
    else if (block_size == BS && a.D == 128) attend<KVK, 128>(a, items);
    else return 3;  // not specialised: the caller uses the PyTorch path
    return 0;
}

}  // namespace

// Returns 0; 1 for bad geometry; 2 for a sequence whose new tokens exceed its context or run past
// the block table; 3 for a (block_size, head_dim) pair without a specialisation.
extern "C" int baton_paged_prefill_attention(
    const void* q, int64_t q_stride_t, int64_t q_stride_h, int q_dtype,
    const void* k_cache, const void* v_cache, int kv_dtype, int64_t num_blocks,
    const float* k_fp8_table, const float* v_fp8_table,
    const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks_per_seq,
    const int32_t* query_start_loc, const int32_t* context_lens,
    void* out, int64_t out_stride_t, int64_t out_stride_h,
    int64_t B, int Hq, int Hk, int D, int block_size, float scale, int64_t window, float softcap, int num_threads) {
    if (Hk <= 0 || Hq % Hk != 0 || Hk > 0xffff || D <= 0) return 1;
    if (q_dtype != kFloat32 && q_dtype != kBFloat16) return 1;
    std::vector<int64_t> items;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b], ctx = context_lens[b];
        if (q_len < 0 || q_len > ctx || ctx > max_blocks_per_seq * block_size || q_len >= (1 << 24)) return 2;
        for (int h = 0; h < Hk; ++h)
            for (int64_t q0 = 0; q0 < q_len; q0 += kQueryBlock) items.push_back((b << 40) | (int64_t(h) << 24) | q0);
    }
    const Args a{q, q_stride_t, q_stride_h, q_dtype, k_cache, v_cache, num_blocks, k_fp8_table, v_fp8_table,
                 block_tables, bt_stride, max_blocks_per_seq, query_start_loc, context_lens, out, out_stride_t,
                 out_stride_h, B, Hq, Hk, D, scale, window, softcap, num_threads};
    switch (kv_dtype) {
        case kFloat32: return dispatch<kFloat32>(a, block_size, items);
        case kBFloat16: return dispatch<kBFloat16>(a, block_size, items);
        case kFp8E4M3: return dispatch<kFp8E4M3>(a, block_size, items);
        default: return 1;
    }
}
