// Per-block integrity sums of KV blocks laid out as [rows, num_blocks, block_bytes] (rows = layers x K/V),
// and the same copy as kv_block_copy.cpp with the sums of the source taken on the way.
// kernels/block_checksum.py has the definition, its numpy reference and the reason for this sum.
//
// The words of block b are its rows' pieces in row order, each piece read as little-endian 64-bit
// words (a tail of fewer than 8 bytes is zero-extended into one more word); with t the word's
// position in the block:  s1 = sum w_t,  s2 = sum w_t * (2t + 1)  (both mod 2^64).
// out[2i] = s1 and out[2i + 1] = s2 of block ids[i].
//
// The fused copy sums each piece in 1 KiB steps right after copying the step, so the sum reads the
// source from L1 instead of memory: its cost is arithmetic, not a second pass over the data.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

inline void sum_words(const uint8_t* p, int64_t nbytes, uint64_t t0, uint64_t& s1, uint64_t& s2) {
    const int64_t nw = nbytes / 8;
    uint64_t a = 0, b = 0;
    int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    // 16 words a turn in two independent accumulator pairs; weights 2t + 1 per lane.
    if (nw >= 16) {
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
        __m512i w0 = _mm512_add_epi64(_mm512_set1_epi64(int64_t(2 * t0 + 1)),
                                      _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0));
        __m512i w1 = _mm512_add_epi64(w0, _mm512_set1_epi64(16));
        const __m512i step = _mm512_set1_epi64(32);
        for (; j + 16 <= nw; j += 16) {
            const __m512i x0 = _mm512_loadu_si512(p + 8 * j), x1 = _mm512_loadu_si512(p + 8 * j + 64);
            a0 = _mm512_add_epi64(a0, x0);
            a1 = _mm512_add_epi64(a1, x1);
            b0 = _mm512_add_epi64(b0, _mm512_mullo_epi64(x0, w0));
            b1 = _mm512_add_epi64(b1, _mm512_mullo_epi64(x1, w1));
            w0 = _mm512_add_epi64(w0, step);
            w1 = _mm512_add_epi64(w1, step);
        }
        a += uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1)));
        b += uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(b0, b1)));
    }
#endif
    // The rest (or all, without AVX-512DQ): auto-vectorised; memcpy keeps unaligned loads defined.
    for (; j < nw; ++j) {
        uint64_t w;
        std::memcpy(&w, p + 8 * j, 8);
        a += w;
        b += w * (2 * (t0 + uint64_t(j)) + 1);
    }
    const int64_t tail = nbytes - 8 * nw;
    if (tail) {
        uint64_t w = 0;
        std::memcpy(&w, p + 8 * nw, size_t(tail));
        a += w;
        b += w * (2 * (t0 + uint64_t(nw)) + 1);
    }
    s1 += a;
    s2 += b;
}

inline void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, bool streaming) {
#if defined(__AVX512F__)
    if (streaming) {
        for (int64_t i = 0; i < n; i += 64)
            _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
        return;
    }
#elif defined(__AVX__)
    if (streaming) {
        for (int64_t i = 0; i < n; i += 32)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        return;
    }
#endif
    (void)streaming;
    std::memcpy(dst, src, size_t(n));
}

inline bool ids_ok(const int64_t* ids, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= num_blocks) return false;
    return true;
}

}  // namespace

// Status: 0 ok, 1 an id out of range.
extern "C" int baton_kv_block_sums(const uint8_t* base, int64_t row_stride, int64_t num_blocks, int64_t rows,
                                   int64_t block_bytes, const int64_t* ids, int64_t n, uint64_t* out) {
    if (!ids_ok(ids, n, num_blocks)) return 1;
    const uint64_t words_per_piece = uint64_t((block_bytes + 7) / 8);
    for (int64_t i = 0; i < n; ++i) {
        uint64_t s1 = 0, s2 = 0;
        for (int64_t r = 0; r < rows; ++r)
            sum_words(base + r * row_stride + ids[i] * block_bytes, block_bytes, uint64_t(r) * words_per_piece, s1, s2);
        out[2 * i] = s1;
        out[2 * i + 1] = s2;
    }
    return 0;
}

namespace {

constexpr int64_t kInterleaveStep = 1024;  // bytes of one piece copied (and summed) before the next
constexpr int kInterleave = 8;              // pieces in flight together, as kv_block_copy.cpp
constexpr int64_t kLongPiece = 32 * 1024;   // a piece this long streams well on its own

struct SumPiece {
    uint8_t* dst;
    const uint8_t* src;
    int64_t len;
    uint64_t t0;  // position of the piece's first word in its block
    uint64_t* sums;  // its block's (s1, s2)
};

// Round-robin over up to kInterleave pieces, kInterleaveStep bytes of each per turn, each step summed
// right after it is copied (from L1). kInterleaveStep is a multiple of 8, so a step's words continue the
// piece's count.
void copy_sum_interleaved(const SumPiece* pieces, int count, bool streaming) {
    int64_t longest = 0;
    for (int k = 0; k < count; ++k) longest = pieces[k].len > longest ? pieces[k].len : longest;
    for (int64_t off = 0; off < longest; off += kInterleaveStep)
        for (int k = 0; k < count; ++k) {
            const SumPiece& p = pieces[k];
            const int64_t left = p.len - off;
            if (left <= 0) continue;
            const int64_t n = left < kInterleaveStep ? left : kInterleaveStep;
            copy_bytes(p.dst + off, p.src + off, n, streaming);
            sum_words(p.src + off, n, p.t0 + uint64_t(off / 8), p.sums[0], p.sums[1]);
        }
}

}  // namespace

// dst[r, dst_ids[i]] = src[r, src_ids[i]] for every row, and out[2i], out[2i + 1] = the sums of the
// bytes copied for pair i. Scattered blocks: eight pieces (a block of one row each) in flight at once,
// as kv_block_copy.cpp does; long pieces straight through. Status: 0 ok, 1 an id out of range.
extern "C" int baton_copy_kv_blocks_summed(uint8_t* dst, int64_t dst_row_stride, int64_t dst_num_blocks,
                                           const uint8_t* src, int64_t src_row_stride, int64_t src_num_blocks,
                                           int64_t rows, int64_t block_bytes, const int64_t* dst_ids,
                                           const int64_t* src_ids, int64_t n, uint64_t* out, int64_t streaming_ok) {
    if (!ids_ok(dst_ids, n, dst_num_blocks) || !ids_ok(src_ids, n, src_num_blocks)) return 1;
    const bool streaming = streaming_ok && (reinterpret_cast<uintptr_t>(dst) % 64 == 0) && dst_row_stride % 64 == 0 &&
                           block_bytes % 64 == 0;
    const uint64_t words_per_piece = uint64_t((block_bytes + 7) / 8);
    for (int64_t i = 0; i < 2 * n; ++i) out[i] = 0;
    SumPiece batch[kInterleave];
    int batched = 0;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) {
            const SumPiece piece{dst + r * dst_row_stride + dst_ids[i] * block_bytes,
                                 src + r * src_row_stride + src_ids[i] * block_bytes, block_bytes,
                                 uint64_t(r) * words_per_piece, out + 2 * i};
            if (block_bytes >= kLongPiece) {
                copy_sum_interleaved(&piece, 1, streaming);
                continue;
            }
            batch[batched++] = piece;
            if (batched == kInterleave) {
                copy_sum_interleaved(batch, batched, streaming);
                batched = 0;
            }
        }
    if (batched) copy_sum_interleaved(batch, batched, streaming);
#if defined(__SSE2__)
    if (streaming) _mm_sfence();  // weakly ordered stores: visible before the caller publishes "done"
#endif
    return 0;
}
