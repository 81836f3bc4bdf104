// Per-block integrity sums of KV blocks laid out as [rows, num_blocks, block_bytes] (rows = layers x K/V),
// and the same copy as kv_block_copy.cpp with the sums of the source taken on the way.
// kernels/block_checksum.py has the definition, its numpy reference and the reason for this sum.
//
// The words of block b are its rows' pieces in row order, each piece read as little-endian 64-bit
// words (a tail of fewer than 8 bytes is zero-extended into one more word); with t the word's
// position in the block:  s1 = sum w_t,  s2 = sum w_t * (2t + 1)  (both mod 2^64).
// out[2i] = s1 and out[2i + 1] = s2 of block ids[i].
//
// The fused copy sums each piece in 256-byte steps right after copying the step, so the sum reads the
// source from L1 instead of memory: its cost is arithmetic, not a second pass over the data.
// It works through the blocks in chunks of whole blocks (every row of them) and, when given a
// counter, publishes after each chunk how many blocks have fully landed: a receiver in another
// process (kvtransfer/shm.py) sums each chunk while the next one is copied, so its verification
// overlaps the copy instead of re-reading everything after it. baton_kv_block_sums_follow is that receiver's
// side: one call that sums the chunks as their count moves and waits between them on the core it has
// (pause, then yield to whatever else is runnable) rather than sleeping: on a loaded machine every sleep
// costs a wake-up that can take longer than the copy has left.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <sched.h>
#include <time.h>

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

namespace {

constexpr int64_t kInterleaveStep = 256;   // bytes of one piece copied (and summed) before the next
constexpr int kInterleave = 8;              // pieces in flight together, as kv_block_copy.cpp
constexpr int64_t kLongPiece = 32 * 1024;   // a piece this long streams well on its own

struct ReadPiece {
    const uint8_t* src;
    int64_t len;
    uint64_t t0;  // position of the piece's first word in its block
    uint64_t* sums;  // its block's (s1, s2)
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// As stream_copy_accumulate below, without the copy: a += line, b += a (a piece of whole lines).
inline void accumulate_lines(const uint8_t* src, int64_t n, __m512i& a, __m512i& b) {
    __m512i la = a, lb = b;  // in registers for the step (see stream_copy_accumulate)
    for (int64_t i = 0; i < n; i += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(src + i + kInterleaveStep), _MM_HINT_T0);
        la = _mm512_add_epi64(la, _mm512_loadu_si512(src + i));
        lb = _mm512_add_epi64(lb, la);
    }
    a = la;
    b = lb;
}

// s1 and s2 of a piece of len / 64 whole lines from its accumulators a and b. Lane l of line i holds word
// t = t0 + 8i + l, weight 2t + 1 = (2 t0 + 2l + 1) + 16 i; after m lines a = sum_i x_i and
// b = sum_i (m - i) x_i, so sum_i i x_i = m a - b and s2 = sum over lanes of (2 t0 + 2l + 1) a + 16 (m a - b).
inline void finish_lines(uint64_t t0, int64_t len, uint64_t* sums, __m512i a, __m512i b) {
    const __m512i base = _mm512_add_epi64(_mm512_set1_epi64(int64_t(2 * t0 + 1)),
                                          _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0));
    const __m512i ia = _mm512_sub_epi64(_mm512_mullo_epi64(_mm512_set1_epi64(len / 64), a), b);
    sums[0] += uint64_t(_mm512_reduce_add_epi64(a));
    sums[1] += uint64_t(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_mullo_epi64(base, a), _mm512_slli_epi64(ia, 4))));
}
#endif

// Round-robin over up to kInterleave pieces, kInterleaveStep bytes of each per turn: each piece is a
// separate memory stream (rows of one block lie num_blocks blocks apart), and several at once keep the
// memory system busy where one at a time waits for each stream's prefetch to ramp up: the shm receiver
// reads blocks from memory right after another core wrote them, and has to keep up with that copy.
void sum_interleaved(const ReadPiece* pieces, int count) {
    int64_t longest = 0;
    for (int k = 0; k < count; ++k) longest = pieces[k].len > longest ? pieces[k].len : longest;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (longest % 64 == 0) {  // every piece has the same length: whole lines
        __m512i acc[2 * kInterleave];
        for (int k = 0; k < 2 * count; ++k) acc[k] = _mm512_setzero_si512();
        for (int64_t off = 0; off < longest; off += kInterleaveStep)
            for (int k = 0; k < count; ++k)
                accumulate_lines(pieces[k].src + off, longest - off < kInterleaveStep ? longest - off : kInterleaveStep,
                                 acc[2 * k], acc[2 * k + 1]);
        for (int k = 0; k < count; ++k) finish_lines(pieces[k].t0, longest, pieces[k].sums, acc[2 * k], acc[2 * k + 1]);
        return;
    }
#endif
    for (int64_t off = 0; off < longest; off += kInterleaveStep)
        for (int k = 0; k < count; ++k) {
            const ReadPiece& p = pieces[k];
            const int64_t left = p.len - off;
            if (left <= 0) continue;
            sum_words(p.src + off, left < kInterleaveStep ? left : kInterleaveStep, p.t0 + uint64_t(off / 8),
                      p.sums[0], p.sums[1]);
        }
}

}  // namespace

// Status: 0 ok, 1 an id out of range.
extern "C" int baton_kv_block_sums(const uint8_t* base, int64_t row_stride, int64_t num_blocks, int64_t rows,
                                   int64_t block_bytes, const int64_t* ids, int64_t n, uint64_t* out) {
    if (!ids_ok(ids, n, num_blocks)) return 1;
    const uint64_t words_per_piece = uint64_t((block_bytes + 7) / 8);
    for (int64_t i = 0; i < 2 * n; ++i) out[i] = 0;
    ReadPiece batch[kInterleave];
    int batched = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < rows; ++r) {
            const ReadPiece piece{base + r * row_stride + ids[i] * block_bytes, block_bytes,
                                  uint64_t(r) * words_per_piece, out + 2 * i};
            if (block_bytes >= kLongPiece) {
                sum_interleaved(&piece, 1);
                continue;
            }
            batch[batched++] = piece;
            if (batched == kInterleave) {
                sum_interleaved(batch, batched);
                batched = 0;
            }
        }
    if (batched) sum_interleaved(batch, batched);
    return 0;
}

namespace {

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
#if defined(__AVX512F__) && defined(__AVX512DQ__)
// n bytes (whole 64-byte lines, dst 64-byte aligned) copied with streaming stores, each line added to
// the lane accumulators on its way through a register: a += line, then b += a. No multiply per word:
// after m lines, a = sum_i x_i and b = sum_i (m - i) x_i per lane, so sum_i i x_i = m a - b, and the
// piece's weighted sum follows from a and b once at its end (see finish_piece).
inline void stream_copy_accumulate(uint8_t* dst, const uint8_t* src, int64_t n, __m512i& a, __m512i& b) {
    // No software prefetch: the eight interleaved pieces keep enough loads in flight, and a prefetch of
    // each piece's next step made both this copy and the one without sums 5-10% slower on the 2-core
    // development VM (16 MiB, contiguous and scattered ids).
    // The accumulators in locals: through the references (into an array the stores to dst may alias)
    // they went to memory and back for every line, a store-to-load chain that cost the copy ~3-4%.
    __m512i la = a, lb = b;
    for (int64_t i = 0; i < n; i += 64) {
        const __m512i x = _mm512_loadu_si512(src + i);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), x);
        la = _mm512_add_epi64(la, x);
        lb = _mm512_add_epi64(lb, la);
    }
    a = la;
    b = lb;
}

inline void finish_piece(const SumPiece& p, __m512i a, __m512i b) { finish_lines(p.t0, p.len, p.sums, a, b); }

// The same copy without the sums (a sender with checksums off): the same loads and stores, so that the
// two differ by the sums alone.
inline void stream_copy_lines(uint8_t* dst, const uint8_t* src, int64_t n) {
    for (int64_t i = 0; i < n; i += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
}
#endif

// sums false: copy only (SumPiece::sums unused).
void copy_sum_interleaved(const SumPiece* pieces, int count, bool streaming, bool sums) {
    int64_t longest = 0;
    for (int k = 0; k < count; ++k) longest = pieces[k].len > longest ? pieces[k].len : longest;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (streaming && !sums) {
        for (int64_t off = 0; off < longest; off += kInterleaveStep)
            for (int k = 0; k < count; ++k) {
                const int64_t left = pieces[k].len - off;
                if (left > 0)
                    stream_copy_lines(pieces[k].dst + off, pieces[k].src + off,
                                      left < kInterleaveStep ? left : kInterleaveStep);
            }
        return;
    }
    if (streaming) {  // whole lines only (the caller's condition): one load per line feeds the store and the
                      // sums, two adds per line, and each piece's lanes reduced once at its end
        __m512i acc[2 * kInterleave];
        for (int k = 0; k < 2 * count; ++k) acc[k] = _mm512_setzero_si512();
        for (int64_t off = 0; off < longest; off += kInterleaveStep)
            for (int k = 0; k < count; ++k) {
                const SumPiece& p = pieces[k];
                const int64_t left = p.len - off;
                if (left > 0)
                    stream_copy_accumulate(p.dst + off, p.src + off, left < kInterleaveStep ? left : kInterleaveStep,
                                           acc[2 * k], acc[2 * k + 1]);
            }
        for (int k = 0; k < count; ++k) finish_piece(pieces[k], acc[2 * k], acc[2 * k + 1]);
        return;
    }
#endif
    for (int64_t off = 0; off < longest; off += kInterleaveStep)
        for (int k = 0; k < count; ++k) {
            const SumPiece& p = pieces[k];
            const int64_t left = p.len - off;
            if (left <= 0) continue;
            const int64_t n = left < kInterleaveStep ? left : kInterleaveStep;
            copy_bytes(p.dst + off, p.src + off, n, streaming);
            if (sums) sum_words(p.src + off, n, p.t0 + uint64_t(off / 8), p.sums[0], p.sums[1]);
        }
}

}  // namespace

// dst[r, dst_ids[i]] = src[r, src_ids[i]] for every row, and out[2i], out[2i + 1] = the sums of the
// bytes copied for pair i. Scattered blocks: eight pieces (a block of one row each) in flight at once,
// as kv_block_copy.cpp does; long pieces straight through. Pairs go chunk_blocks at a time (all of
// them at once when chunk_blocks <= 0); after each chunk, when `landed` is not null, every store of
// the chunk is made visible and then *landed = the number of pairs done (a release store), so that a
// reader who sees the count also sees those blocks. out null: the same copy without the sums (checksums
// off). Status: 0 ok, 1 an id out of range.
extern "C" int baton_copy_kv_blocks_summed(uint8_t* dst, int64_t dst_row_stride, int64_t dst_num_blocks,
                                           const uint8_t* src, int64_t src_row_stride, int64_t src_num_blocks,
                                           int64_t rows, int64_t block_bytes, const int64_t* dst_ids,
                                           const int64_t* src_ids, int64_t n, uint64_t* out, int64_t streaming_ok,
                                           int64_t* landed, int64_t chunk_blocks) {
    if (!ids_ok(dst_ids, n, dst_num_blocks) || !ids_ok(src_ids, n, src_num_blocks)) return 1;
    const bool streaming = streaming_ok && (reinterpret_cast<uintptr_t>(dst) % 64 == 0) && dst_row_stride % 64 == 0 &&
                           block_bytes % 64 == 0;
    const uint64_t words_per_piece = uint64_t((block_bytes + 7) / 8);
    const int64_t chunk = chunk_blocks > 0 ? chunk_blocks : (n > 0 ? n : 1);
    const bool sums = out != nullptr;
    if (sums)
        for (int64_t i = 0; i < 2 * n; ++i) out[i] = 0;
    SumPiece batch[kInterleave];
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
        int batched = 0;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = c0; i < c1; ++i) {
                const SumPiece piece{dst + r * dst_row_stride + dst_ids[i] * block_bytes,
                                     src + r * src_row_stride + src_ids[i] * block_bytes, block_bytes,
                                     uint64_t(r) * words_per_piece, sums ? out + 2 * i : nullptr};
                if (block_bytes >= kLongPiece) {
                    copy_sum_interleaved(&piece, 1, streaming, sums);
                    continue;
                }
                batch[batched++] = piece;
                if (batched == kInterleave) {
                    copy_sum_interleaved(batch, batched, streaming, sums);
                    batched = 0;
                }
            }
        if (batched) copy_sum_interleaved(batch, batched, streaming, sums);
#if defined(__SSE2__)
        // Weakly ordered (non-temporal) stores: visible before the count, or the caller's "done", is.
        if (streaming) _mm_sfence();
#endif
        if (landed != nullptr) __atomic_store_n(landed, c1, __ATOMIC_RELEASE);
    }
    return 0;
}

namespace {

inline int64_t monotonic_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

inline int64_t landed_count(const int64_t* landed, int64_t n) {
    const int64_t v = __atomic_load_n(landed, __ATOMIC_ACQUIRE);
    return v < 0 ? 0 : (v > n ? n : v);
}

}  // namespace

// The receiver's side of baton_copy_kv_blocks_summed with a counter: sums blocks ids[*done..) into
// out[2 * *done..) while another process copies them in, *landed (an acquire load) being how many blocks,
// in transfer order, have fully landed. Returns when every landed block is summed and either *state is no
// longer busy_state (the copy ended or was called off: the caller looks at the slot) or nothing new has
// landed for max_wait_ns (a stalled or dead sender: the caller backs off). *done: the blocks summed so far,
// in on entry and kept current (a release store after each batch of sums is written), so that another
// thread that takes over, e.g. to land the transfer while this one lags, reads how far it got and sums
// only the rest. Status: 0 ok, 1 an id out of range.
extern "C" int baton_kv_block_sums_follow(const uint8_t* base, int64_t row_stride, int64_t num_blocks, int64_t rows,
                                          int64_t block_bytes, const int64_t* ids, int64_t n, uint64_t* out,
                                          int64_t* done, const int64_t* landed, const int64_t* state,
                                          int64_t busy_state, int64_t max_wait_ns) {
    if (!ids_ok(ids, n, num_blocks)) return 1;
    int64_t have = __atomic_load_n(done, __ATOMIC_ACQUIRE);
    have = have < 0 ? 0 : (have > n ? n : have);
    int64_t quiet_since = monotonic_ns();
    for (;;) {
        // Read the state before the count: a copy that ended has published its last count before its state.
        const bool busy = __atomic_load_n(state, __ATOMIC_ACQUIRE) == busy_state;
        const int64_t upto = landed_count(landed, n);
        if (upto > have) {
            baton_kv_block_sums(base, row_stride, num_blocks, rows, block_bytes, ids + have, upto - have, out + 2 * have);
            have = upto;
            __atomic_store_n(done, have, __ATOMIC_RELEASE);
            quiet_since = monotonic_ns();
            continue;
        }
        if (!busy || monotonic_ns() - quiet_since >= max_wait_ns) break;
        for (int k = 0; k < 64; ++k) {
#if defined(__SSE2__)
            _mm_pause();
#endif
        }
        sched_yield();
    }
    return 0;
}
