// A grammar's token bitmask applied to float32 logits in place: token t of row r stays where bit
// (t % 32) of word bitmask[r, t / 32] is set and becomes -inf where it is clear. Structured output
// leaves few tokens allowed, so whole words are usually 0 (32 logits set at once) or -1 (skipped);
// only mixed words are walked bit by bit. kernels/token_bitmask.py holds the reference.

#include <cmath>
#include <cstdint>
#include <limits>

extern "C" int baton_apply_token_bitmask(float* logits, int64_t logits_stride, const int32_t* bitmask,
                                         int64_t bitmask_stride, const int64_t* rows, int64_t num_rows,
                                         int64_t vocab, int num_threads) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < num_rows; ++i) {
        float* x = logits + rows[i] * logits_stride;
        const int32_t* mask = bitmask + rows[i] * bitmask_stride;
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t m = static_cast<uint32_t>(mask[w]);
            if (m == 0xffffffffu) continue;
            float* block = x + w * 32;
            const int64_t n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
            if (m == 0) {
                for (int64_t j = 0; j < n; ++j) block[j] = neg_inf;
            } else {
                for (int64_t j = 0; j < n; ++j)
                    if (!((m >> j) & 1u)) block[j] = neg_inf;
            }
        }
    }
    return 0;
}
