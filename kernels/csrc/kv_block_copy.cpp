// Copy KV blocks between two caches laid out as [rows, num_blocks, block_bytes] (rows = layers x K/V):
// dst[r, dst_ids[i]] = src[r, src_ids[i]] for every row r and pair i. kernels/block_copy.py has the reference.
//
// Why not one memcpy per block and row: with scattered ids every piece (a block of one layer's K or
// V, 4-8 KiB) starts a fresh memory stream, and one stream at a time leaves the memory system idle
// while the hardware prefetcher ramps up and the page walks complete. Eight pieces interleaved in
// 256-byte steps keep several streams going, which brings scattered blocks close to the speed of
// one contiguous memcpy (bench/kv_transfer.py). A run of consecutive ids of 32 KiB or more
// streams well on its own and is copied straight through (cutting it into pieces and
// interleaving those made large transfers slower). Stores bypass the cache where the destination
// is 64-byte aligned: another process reads the blocks later, and skipping the
// read-for-ownership of each destination line saves a third of the memory traffic.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStep = 256;              // bytes copied from one piece before moving to the next
constexpr int kInterleave = 8;              // pieces in flight together
constexpr int64_t kLongRun = 32 * 1024;     // a run this long is copied straight through

struct Piece {
    uint8_t* dst;
    const uint8_t* src;
    int64_t len;
};

// Copies whole 64-byte lines with non-temporal stores; needs dst 64-byte aligned and n % 64 == 0.
inline void stream_lines(uint8_t* dst, const uint8_t* src, int64_t n) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < n; i += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX__)
    for (int64_t i = 0; i < n; i += 32)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#elif defined(__SSE2__)
    for (int64_t i = 0; i < n; i += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#else
    std::memcpy(dst, src, size_t(n));
#endif
}

inline void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, bool streaming) {
    if (streaming) stream_lines(dst, src, n);
    else std::memcpy(dst, src, size_t(n));
}

// Round-robin over up to kInterleave pieces, kStep bytes of each per turn.
void copy_interleaved(const Piece* pieces, int count, bool streaming) {
    int64_t longest = 0;
    for (int k = 0; k < count; ++k) longest = pieces[k].len > longest ? pieces[k].len : longest;
    for (int64_t off = 0; off < longest; off += kStep)
        for (int k = 0; k < count; ++k) {
            const int64_t left = pieces[k].len - off;
            if (left > 0) copy_bytes(pieces[k].dst + off, pieces[k].src + off, left < kStep ? left : kStep, streaming);
        }
}

}  // namespace

// Status: 0 ok, 1 an id out of range. Ids are checked here too (the caller checks them with a
// clear message first) so that a bad id can never write outside the destination cache.
extern "C" int baton_copy_kv_blocks(uint8_t* dst, int64_t dst_row_stride, int64_t dst_num_blocks,
                                    const uint8_t* src, int64_t src_row_stride, int64_t src_num_blocks,
                                    int64_t rows, int64_t block_bytes, const int64_t* dst_ids,
                                    const int64_t* src_ids, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (dst_ids[i] < 0 || dst_ids[i] >= dst_num_blocks || src_ids[i] < 0 || src_ids[i] >= src_num_blocks)
            return 1;
    if (n == 0) return 0;  // the id pointers may be null then
    // Runs where both id lists count up together become one piece per row.
    std::vector<int64_t> run_start{0};
    for (int64_t i = 1; i < n; ++i)
        if (dst_ids[i] != dst_ids[i - 1] + 1 || src_ids[i] != src_ids[i - 1] + 1) run_start.push_back(i);
    run_start.push_back(n);
    // Streaming stores need every destination line whole: aligned starts and lengths.
    const bool streaming = (reinterpret_cast<uintptr_t>(dst) % 64 == 0) && dst_row_stride % 64 == 0 &&
                           block_bytes % 64 == 0;

    Piece batch[kInterleave];
    int batched = 0;
    for (int64_t r = 0; r < rows; ++r)
        for (size_t k = 0; k + 1 < run_start.size(); ++k) {
            const int64_t i = run_start[k], len = (run_start[k + 1] - i) * block_bytes;
            uint8_t* d = dst + r * dst_row_stride + dst_ids[i] * block_bytes;
            const uint8_t* s = src + r * src_row_stride + src_ids[i] * block_bytes;
            if (len >= kLongRun) {  // streams well on its own
                copy_bytes(d, s, len, streaming);
                continue;
            }
            batch[batched++] = Piece{d, s, len};
            if (batched == kInterleave) {
                copy_interleaved(batch, batched, streaming);
                batched = 0;
            }
        }
    if (batched) copy_interleaved(batch, batched, streaming);
#if defined(__SSE2__)
    // Non-temporal stores are weakly ordered: make them visible before the caller publishes
    // "transfer done" with an ordinary store.
    if (streaming) _mm_sfence();
#endif
    return 0;
}
