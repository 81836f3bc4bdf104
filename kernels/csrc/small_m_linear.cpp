// float32 linear layer for decode-sized batches: y[M, N] = x[M, K] . W^T, with W packed once as
// [N / 16][K][16] (kernels/small_m_linear.py: pack_weight), N a multiple of 16.
//
// With a few rows, oneDNN's prepacked linear neither streams the weights at the memory's pace nor
// keeps the FMA units busy (bench/small_m_linear.py). Here one panel of 48 outputs streams from
// memory as a single sequential run; a register block of 8 rows x 48 outputs (24 accumulators)
// feeds 3 FMAs from each broadcast of x; further blocks of 8 rows read the panel again from L2, and
// while the last block computes, the panel after it is prefetched. Threads split the panels.
// Each output is one sum over k in order (vectors along N, never across K), so the result does not
// depend on the thread count.

#include "baton_cpu.h"

using namespace baton;

namespace {

constexpr int64_t kPanel = 3;  // 16-output blocks per panel

template <int MB, int NB>
inline void block(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t K,
                  const float* next) {
    v16 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) acc[m][b] = v16{};
    for (int64_t k = 0; k < K; ++k) {
        v16 wv[NB];
        for (int b = 0; b < NB; ++b) wv[b] = load(w + (b * K + k) * 16);
        if (next)
            for (int b = 0; b < NB; ++b) __builtin_prefetch(next + (b * K + k) * 16, 0, 2);
        for (int m = 0; m < MB; ++m) {
            const v16 xv = v16{} + x[m * x_stride + k];
            for (int b = 0; b < NB; ++b) acc[m][b] += xv * wv[b];
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int b = 0; b < NB; ++b) store(y + m * y_stride + b * 16, acc[m][b]);
}

template <int NB>
void panel(const float* x, int64_t x_stride, int64_t M, const float* w, float* y, int64_t y_stride, int64_t K,
           const float* next) {
    int64_t m = 0;
    for (; m + 8 <= M; m += 8)
        block<8, NB>(x + m * x_stride, x_stride, w, y + m * y_stride, y_stride, K, m + 8 >= M ? next : nullptr);
    for (; m < M; ++m)
        block<1, NB>(x + m * x_stride, x_stride, w, y + m * y_stride, y_stride, K, m + 1 >= M ? next : nullptr);
}

}  // namespace

// Returns 0, or 1 for arguments it cannot take.
extern "C" int baton_small_m_linear(const float* x, int64_t x_stride, int64_t M, const float* w_packed, float* y,
                                    int64_t y_stride, int64_t K, int64_t N, int num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || N % 16 != 0 || x_stride < K || y_stride < N || num_threads < 1) return 1;
    const int64_t blocks = N / 16, panels = (blocks + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t b0 = p * kPanel;
        const float* w = w_packed + b0 * K * 16;
        float* out = y + b0 * 16;
        if (b0 + kPanel <= blocks) {
            const float* next = b0 + 2 * kPanel <= blocks ? w + kPanel * K * 16 : nullptr;
            panel<kPanel>(x, x_stride, M, w, out, y_stride, K, next);
        } else {
            for (int64_t b = b0; b < blocks; ++b)
                panel<1>(x, x_stride, M, w_packed + b * K * 16, y + b * 16, y_stride, K, nullptr);
        }
    }
    return 0;
}
