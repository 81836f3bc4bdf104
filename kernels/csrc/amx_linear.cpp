// float32 linear layer for prompt rows on Intel AMX: y[M, N] = x[M, K] . W^T with each product taken
// as three bfloat16 products (bf16x3): x = xh + xl and w = wh + wl, each part a bfloat16, and
// x w ~ xh wh + xh wl + xl wh, accumulated in float32 by the tile unit. What is left out (xl wl and
// what 16 bits of significand cannot hold) is ~2^-16 of each product, far below TF32's ~2^-11
// (kernels/amx_linear.py has the reference and the measured error). One AMX tile multiply does
// 16 x 16 x 32 multiply-adds, so the three products still run faster than the float32 FMA units.
//
// The weight is split once, at load time (baton_amx_pack_weight), from kernels/small_m_linear.py's
// [N / 16][K][16] float32 packing into tiles of [N / 16][Kp / 32][hi, lo][16 pairs of k][16 n x 2]
// bfloat16, the pair-interleaved (VNNI) layout the tile unit reads; Kp is K rounded up to 32, the
// pad zeros. Each call splits x into padded bfloat16 rows the same way. Every output is its own sum
// over k in the same order whatever the rows beside it, so a row gets the same bits alone or in any
// batch (padding rows are zeros and are never stored).

#include <cstdint>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define BATON_AMX 1
#include <immintrin.h>
#endif

#include "baton_cpu.h"

namespace {

constexpr int64_t kTileK = 32;     // bfloat16 elements of k per tile row
constexpr int64_t kTileRows = 16;  // rows of x (and pairs of k) per tile
constexpr int64_t kRowBlock = 256;  // rows of x whose split copies stay in L2 while the weights stream past

inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// hi = bfloat16(v), lo = bfloat16(v - hi), both rounded to nearest even.
inline void split(float v, uint16_t& hi, uint16_t& lo) {
    hi = baton::float_to_bf16(v);
    lo = baton::float_to_bf16(v - baton::bf16_to_float(hi));
}

#ifdef BATON_AMX

// A row of x split into its padded hi and lo rows (zeros past K; all zeros for a padding row, x null).
inline void split_row(const float* x, int64_t K, int64_t kp, uint16_t* hi, uint16_t* lo) {
    int64_t k = 0;
    if (x != nullptr)
        for (; k < K; k += 16) {
            const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(mask, x + k);
            const __m256bh h = _mm512_cvtneps_pbh(v);
            const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k), (__m256i)h);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
        }
    for (; k < kp; ++k) hi[k] = lo[k] = 0;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3: float32 sums of a 32 x 32 output block; 4-5: 16 rows of x each; 6-7: 16 outputs of w each.
inline void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = kTileRows;
    }
    _tile_loadconfig(&cfg);
}

// The sums (tiles 0-3) += the x tiles (4, 5) times the weight tiles (6, and 7 with NT = 2).
template <int NT>
inline void multiply_loaded() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (NT == 2) {
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}

// Sum tile `tile` (0-3) to 16 rows `stride_bytes` apart; tile numbers must be constants.
inline void store_sums(int tile, float* out, int64_t stride_bytes) {
    switch (tile) {
        case 0: _tile_stored(0, out, stride_bytes); break;
        case 1: _tile_stored(1, out, stride_bytes); break;
        case 2: _tile_stored(2, out, stride_bytes); break;
        default: _tile_stored(3, out, stride_bytes); break;
    }
}

// The x rows [m, m + 32) (split, padded) against the weight tiles of outputs [16 nt, 16 nt + 16 NT).
template <int NT>
inline void block(const uint16_t* xh, const uint16_t* xl, int64_t kp, const uint16_t* w, int64_t nt, float* y,
                  int64_t y_stride, int64_t rows_left, int64_t n0) {
    const int64_t kblocks = kp / kTileK, tile_elems = kTileRows * kTileK;  // 512 bfloat16 per tile
    const int64_t x_bytes = kp * 2, nt_stride = kblocks * 2 * tile_elems;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* w0 = w + nt * nt_stride;
    const uint16_t* w1 = w0 + nt_stride;
    for (int64_t kb = 0; kb < kblocks; ++kb) {
        const int64_t xo = kb * kTileK, wo = kb * 2 * tile_elems;
        _tile_loadd(4, xh + xo, x_bytes);  // xh wh
        _tile_loadd(5, xh + kTileRows * kp + xo, x_bytes);
        _tile_loadd(6, w0 + wo, 64);
        if (NT == 2) _tile_loadd(7, w1 + wo, 64);
        multiply_loaded<NT>();
        _tile_loadd(4, xl + xo, x_bytes);  // xl wh
        _tile_loadd(5, xl + kTileRows * kp + xo, x_bytes);
        multiply_loaded<NT>();
        _tile_loadd(4, xh + xo, x_bytes);  // xh wl
        _tile_loadd(5, xh + kTileRows * kp + xo, x_bytes);
        _tile_loadd(6, w0 + wo + tile_elems, 64);
        if (NT == 2) _tile_loadd(7, w1 + wo + tile_elems, 64);
        multiply_loaded<NT>();
    }
    // Full tiles go straight to y; a tile past the last row goes through a scratch tile.
    alignas(64) float scratch[kTileRows * 16];
    for (int half = 0; half < 2; ++half) {
        const int64_t rows = rows_left - half * kTileRows;
        if (rows <= 0) break;
        for (int j = 0; j < NT; ++j) {
            float* out = y + half * kTileRows * y_stride + n0 + 16 * j;
            if (rows >= kTileRows) {
                store_sums(2 * half + j, out, y_stride * 4);
                continue;
            }
            store_sums(2 * half + j, scratch, 64);
            for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * y_stride, scratch + r * 16, 64);
        }
    }
}

#endif  // BATON_AMX

}  // namespace

extern "C" {

// Whether this process may use the tile unit: built for it, and the kernel granted the tile state
// (Linux asks each process to request it once). 1 yes, 0 no.
int baton_amx_ready() {
#ifdef BATON_AMX
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    static const int ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
    return ready;
#else
    return 0;
#endif
}

// small_m_linear's [N / 16][K][16] float32 packing -> the tiles described above. Returns 0, or 1 for
// arguments it cannot take.
int baton_amx_pack_weight(const float* w_packed, int64_t K, int64_t N, uint16_t* out) {
    if (K <= 0 || N <= 0 || N % 16 != 0) return 1;
    const int64_t kp = round_up(K, kTileK), kblocks = kp / kTileK;
    for (int64_t nt = 0; nt < N / 16; ++nt)
        for (int64_t kb = 0; kb < kblocks; ++kb) {
            uint16_t* hi = out + (nt * kblocks + kb) * 2 * kTileRows * kTileK;
            uint16_t* lo = hi + kTileRows * kTileK;
            for (int64_t pair = 0; pair < kTileRows; ++pair) {
                const int64_t k = kb * kTileK + 2 * pair;
                const float* row = w_packed + (nt * K + k) * 16;  // 16 outputs at k, then at k + 1
#ifdef BATON_AMX
                if (k + 1 < K) {  // both rows there: split 32 values at once, interleaved by k
                    const __m512 a = _mm512_loadu_ps(row), b = _mm512_loadu_ps(row + 16);
                    const __m512i interleave = _mm512_set_epi16(
                        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
                    const __m512bh h = _mm512_cvtne2ps_pbh(b, a);  // a's 16 then b's 16
                    const __m512i hv = (__m512i)h;
                    const __m512 ah = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hv)), 16));
                    const __m512 bh = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hv, 1)), 16));
                    const __m512i lv = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah));
                    _mm512_storeu_si512(hi + pair * 32, _mm512_permutexvar_epi16(interleave, hv));
                    _mm512_storeu_si512(lo + pair * 32, _mm512_permutexvar_epi16(interleave, lv));
                    continue;
                }
#endif
                for (int64_t n = 0; n < 16; ++n)
                    for (int64_t j = 0; j < 2; ++j) {
                        const float v = k + j < K ? row[16 * j + n] : 0.0f;
                        split(v, hi[pair * 32 + 2 * n + j], lo[pair * 32 + 2 * n + j]);
                    }
            }
        }
    return 0;
}

// y = x . W^T for a weight from baton_amx_pack_weight. Returns 0, 1 for arguments it cannot take,
// 2 where the tile unit is unavailable (baton_amx_ready).
int baton_amx_linear(const float* x, int64_t x_stride, int64_t M, const uint16_t* w, float* y, int64_t y_stride,
                     int64_t K, int64_t N, int num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || N % 16 != 0 || x_stride < K || y_stride < N || num_threads < 1) return 1;
#ifdef BATON_AMX
    if (!baton_amx_ready()) return 2;
    if (M == 0) return 0;
    const int64_t kp = round_up(K, kTileK), mp = round_up(M, 2 * kTileRows);
    // Kept between calls: a fresh buffer of a prompt's rows costs more in page faults than the split.
    static thread_local std::vector<uint16_t> xh, xl;
    if (xh.size() < size_t(mp * kp)) {
        xh.resize(size_t(mp * kp));
        xl.resize(size_t(mp * kp));
    }
    uint16_t* const hi = xh.data();  // the threads below must not name the thread_local (each has its own)
    uint16_t* const lo = xl.data();
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t m = 0; m < mp; ++m) split_row(m < M ? x + m * x_stride : nullptr, K, kp, hi + m * kp, lo + m * kp);
    // Work items: one block of rows against 32 outputs (16 for an odd last tile). Each item reads its
    // outputs' weight tiles once and reuses them over the block's rows, which stay in L2 meanwhile.
    const int64_t row_blocks = (mp + kRowBlock - 1) / kRowBlock, pairs = (N / 16 + 1) / 2;
#pragma omp parallel num_threads(num_threads)
    {
        configure();  // per thread: the tile configuration is thread state
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < row_blocks * pairs; ++item) {
            const int64_t rb = item / pairs, p = item % pairs;
            const bool whole = 32 * (p + 1) <= N;
            const int64_t m_end = (rb + 1) * kRowBlock < M ? (rb + 1) * kRowBlock : M;
            for (int64_t m = rb * kRowBlock; m < m_end; m += 2 * kTileRows) {
                if (whole) block<2>(hi + m * kp, lo + m * kp, kp, w, 2 * p, y + m * y_stride, y_stride, M - m, 32 * p);
                else block<1>(hi + m * kp, lo + m * kp, kp, w, 2 * p, y + m * y_stride, y_stride, M - m, 32 * p);
            }
        }
        _tile_release();
    }
    return 0;
#else
    (void)x;
    (void)w;
    (void)y;
    return 2;
#endif
}

}  // extern "C"
