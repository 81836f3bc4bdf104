// float32 linear layer for decode-sized batches: y[M, N] = x[M, K] . W^T, with W packed once as
// [N / 16][K][16] (kernels/small_m_linear.py: pack_weight), N a multiple of 16.
//
// With a few rows, oneDNN's prepacked linear neither streams the weights at the memory's pace nor
// keeps the FMA units busy (bench/small_m_linear.py). Here one panel of 32 outputs streams from
// memory as a single sequential run, through a register block of up to 16 rows x 32 outputs, while
// the panel after it is prefetched into L2 in step with it; further blocks of 16 rows read the
// panel again from L2. On the default model's shapes, one thread, the whole set of linear layers
// took 50.9 ms this way for 16 rows against 40.4 ms for one row, which only streams the weights
// (`python -m bench.small_m_linear`); blocks of 8 rows x 48 outputs that prefetched only during
// the last block had taken 55 ms for 16 rows. Threads split the panels.
// Each output is one sum over k in order (vectors along N, never across K), so the result does not
// depend on the thread count or on the rows beside it.

#include "baton_cpu.h"

using namespace baton;

namespace {

// Two shapes of register block: 9 to 24 rows take blocks of up to 16 rows x 32 outputs (the
// weights then stream from memory once, or once more from L2); up to 8 rows, and more than 24,
// blocks of 8 rows x 48 outputs, where fewer sums per weight load or the blocks after the first
// (computing from L2) went faster that way. The two give the same bits: each output is the same
// sum in the same order.
constexpr int64_t kFewRows = 24;

// MB rows x NB * 16 outputs over the whole of K, the sums in registers (up to 32 of them, which
// GCC keeps in the 32 vector registers of AVX-512 along with the weights), prefetching `next`
// (when given) at the same offsets.
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

// block<rows, NB> for a row count known only at run time (1..MB).
template <int MB, int NB>
inline void rows_block(int64_t rows, const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride,
                       int64_t K, const float* next) {
    if constexpr (MB > 1) {
        if (rows < MB) return rows_block<MB - 1, NB>(rows, x, x_stride, w, y, y_stride, K, next);
    }
    block<MB, NB>(x, x_stride, w, y, y_stride, K, next);
}

// Every row against one panel of NB * 16 outputs, in blocks of up to ROWS rows; the first block
// streams the panel from memory and prefetches the next one.
template <int ROWS, int NB>
void panel(const float* x, int64_t x_stride, int64_t M, const float* w, float* y, int64_t y_stride, int64_t K,
           const float* next) {
    for (int64_t m = 0; m < M; m += ROWS) {
        const int64_t rows = M - m < ROWS ? M - m : ROWS;
        rows_block<ROWS, NB>(rows, x + m * x_stride, x_stride, w, y + m * y_stride, y_stride, K, m == 0 ? next : nullptr);
    }
}

template <int ROWS, int PANEL>
void linear(const float* x, int64_t x_stride, int64_t M, const float* w_packed, float* y, int64_t y_stride,
            int64_t K, int64_t N, int num_threads) {
    const int64_t blocks = N / 16, panels = (blocks + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t b0 = p * PANEL;
        const float* w = w_packed + b0 * K * 16;
        float* out = y + b0 * 16;
        if (b0 + PANEL <= blocks) {
            const float* next = b0 + 2 * PANEL <= blocks ? w + PANEL * K * 16 : nullptr;
            panel<ROWS, PANEL>(x, x_stride, M, w, out, y_stride, K, next);
        } else {
            for (int64_t b = b0; b < blocks; ++b)
                panel<ROWS, 1>(x, x_stride, M, w_packed + b * K * 16, y + b * 16, y_stride, K, nullptr);
        }
    }
}

}  // namespace

// Returns 0, or 1 for arguments it cannot take.
extern "C" int baton_small_m_linear(const float* x, int64_t x_stride, int64_t M, const float* w_packed, float* y,
                                    int64_t y_stride, int64_t K, int64_t N, int num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || N % 16 != 0 || x_stride < K || y_stride < N || num_threads < 1) return 1;
    if (M > 8 && M <= kFewRows) linear<16, 2>(x, x_stride, M, w_packed, y, y_stride, K, N, num_threads);
    else linear<8, 3>(x, x_stride, M, w_packed, y, y_stride, K, N, num_threads);
    return 0;
}
