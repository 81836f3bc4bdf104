// Batched LoRA for CPU tensors (kernels/lora.py): y[r] += scaling[s] * B[s] @ (A[s] @ x[r]) for every
// row r whose slot s = slots[r] is >= 0; a negative slot is the base model (y[r] untouched).
//
// x [rows, in] and y [rows, out] (row strides given: y may be a column slice of a wider tensor),
// A [slots, rank, in] and B [slots, out, rank] (slot and row strides given, last dim contiguous),
// scaling float32 [slots], slots int64 [rows]. float32 or bfloat16 activations; float32 throughout,
// y rounded once.
//
// The rows are grouped by slot (a stable counting sort) into groups of up to kGroup rows of one
// slot, so that each part of A and B read serves every row of a group. Shrink: t[row, r] = A[s][r] .
// x[row], one work item per (group, block of ranks): for each kKChunk columns, the group's dot
// products with each of the block's rows of A (the x columns stay in L1 across the block). Expand:
// y[row, n] += scaling[s] * B[s][n] . t[row], one work item per (group, chunk of kChunk outputs):
// the chunk of B transposed into a [rank][kChunk] float32 buffer, then per row kChunk-wide
// multiply-adds, one per rank (B's rows are only rank long: dot products along them would spend
// their time on horizontal sums). OpenMP over the work items of each phase.

#include <algorithm>
#include <vector>

#include "baton_cpu.h"

using namespace baton;

namespace {

constexpr int kGroup = 8;
constexpr int64_t kChunk = 64;   // outputs per expand work item
constexpr int kRankBlock = 8;     // ranks per shrink work item (when there are enough work items)
constexpr int64_t kKChunk = 512;  // input columns per pass of a shrink work item

struct Group {
    int64_t slot;
    int64_t first;  // index into the order array (and into t's rows)
    int n;          // rows in the group, 1..kGroup
};

// out[i] += sum_{k0 <= k < k1} w[k] * v[i][k] for NR vectors v, one pass over w.
template <typename A, int NR>
inline void dots(const typename A::T* w, const typename A::T* const* v, int64_t k0, int64_t k1, float* out) {
    float acc[NR] = {};
    for (int64_t k = k0; k < k1; ++k) {
        const float wk = A::load(w, k);
        for (int i = 0; i < NR; ++i) acc[i] += wk * A::load(v[i], k);
    }
    for (int i = 0; i < NR; ++i) out[i] += acc[i];
}

template <typename A>
inline void dots_n(int n, const typename A::T* w, const typename A::T* const* v, int64_t k0, int64_t k1, float* out) {
    switch (n) {
        case 1: dots<A, 1>(w, v, k0, k1, out); break;
        case 2: dots<A, 2>(w, v, k0, k1, out); break;
        case 3: dots<A, 3>(w, v, k0, k1, out); break;
        case 4: dots<A, 4>(w, v, k0, k1, out); break;
        case 5: dots<A, 5>(w, v, k0, k1, out); break;
        case 6: dots<A, 6>(w, v, k0, k1, out); break;
        case 7: dots<A, 7>(w, v, k0, k1, out); break;
        default: dots<A, 8>(w, v, k0, k1, out); break;
    }
}

template <int DT>
void lora_rows(const void* x_, int64_t x_stride, void* y_, int64_t y_stride, const void* a_, int64_t a_stride_s,
               int64_t a_stride_r, const void* b_, int64_t b_stride_s, int64_t b_stride_n, const int64_t* slots,
               const float* scaling, int64_t rows, int64_t K, int64_t N, int64_t R, int64_t nslots,
               int num_threads) {
    using A = Act<DT>;
    using T = typename A::T;
    const T* x = static_cast<const T*>(x_);
    T* y = static_cast<T*>(y_);
    const T* a = static_cast<const T*>(a_);
    const T* b = static_cast<const T*>(b_);

    // Rows by slot, each slot's rows in increasing order, then cut into groups.
    std::vector<int64_t> start(nslots + 1, 0);
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] >= 0) ++start[slots[r] + 1];
    for (int64_t s = 0; s < nslots; ++s) start[s + 1] += start[s];
    const int64_t active = start[nslots];
    if (active == 0) return;
    std::vector<int64_t> order(active);
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] >= 0) order[fill[slots[r]]++] = r;
    std::vector<Group> groups;
    for (int64_t s = 0; s < nslots; ++s)
        for (int64_t i = start[s]; i < start[s + 1]; i += kGroup)
            groups.push_back({s, i, int(std::min<int64_t>(kGroup, start[s + 1] - i))});
    const int64_t G = int64_t(groups.size());
    std::vector<float> t(active * R);

    // Several ranks per work item when that leaves work items enough for the threads.
    const int64_t rank_block = G * R >= int64_t(kRankBlock) * 4 * num_threads ? kRankBlock : 1;
    const int64_t rank_blocks = (R + rank_block - 1) / rank_block;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < G * rank_blocks; ++item) {
        const Group& g = groups[item / rank_blocks];
        const int64_t r0 = (item % rank_blocks) * rank_block;
        const int64_t r1 = std::min(R, r0 + rank_block);
        const T* xs[kGroup];
        for (int i = 0; i < g.n; ++i) xs[i] = x + order[g.first + i] * x_stride;
        float out[kRankBlock][kGroup] = {};
        for (int64_t k0 = 0; k0 < K; k0 += kKChunk)
            for (int64_t r = r0; r < r1; ++r)
                dots_n<A>(g.n, a + g.slot * a_stride_s + r * a_stride_r, xs, k0, std::min(K, k0 + kKChunk),
                          out[r - r0]);
        for (int64_t r = r0; r < r1; ++r)
            for (int i = 0; i < g.n; ++i) t[(g.first + i) * R + r] = out[r - r0][i];
    }

    const int64_t chunks = (N + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> bt(R * kChunk);  // this thread's transposed chunk of B
#pragma omp for schedule(static)
        for (int64_t item = 0; item < G * chunks; ++item) {
            const Group& g = groups[item / chunks];
            const int64_t n0 = (item % chunks) * kChunk;
            const int64_t width = std::min(N - n0, kChunk);
            const T* bs = b + g.slot * b_stride_s + n0 * b_stride_n;
            for (int64_t j = 0; j < kChunk; ++j)
                for (int64_t r = 0; r < R; ++r) bt[r * kChunk + j] = j < width ? A::load(bs + j * b_stride_n, r) : 0.0f;
            const float scale = scaling[g.slot];
            for (int i = 0; i < g.n; ++i) {
                const float* tr = t.data() + (g.first + i) * R;
                float acc[kChunk] = {};
                for (int64_t r = 0; r < R; ++r) {
                    const float tv = tr[r];
                    const float* br = bt.data() + r * kChunk;
                    for (int64_t j = 0; j < kChunk; ++j) acc[j] += tv * br[j];
                }
                T* yr = y + order[g.first + i] * y_stride + n0;
                for (int64_t j = 0; j < width; ++j) A::store(yr, j, A::load(yr, j) + scale * acc[j]);
            }
        }
    }
}

}  // namespace

// Returns 0, or 1 for an unsupported dtype, 2 for a slot id >= nslots (then y is untouched).
extern "C" int baton_lora_add(const void* x, int64_t x_stride, void* y, int64_t y_stride, const void* a,
                              int64_t a_stride_s, int64_t a_stride_r, const void* b, int64_t b_stride_s,
                              int64_t b_stride_n, const int64_t* slots, const float* scaling, int64_t rows,
                              int64_t in, int64_t out, int64_t rank, int64_t nslots, int dtype, int num_threads) {
    if (dtype != kFloat32 && dtype != kBFloat16) return 1;
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] >= nslots) return 2;
    if (rows == 0 || in == 0 || out == 0 || rank == 0 || nslots == 0) return 0;
    if (dtype == kFloat32)
        lora_rows<kFloat32>(x, x_stride, y, y_stride, a, a_stride_s, a_stride_r, b, b_stride_s, b_stride_n, slots,
                            scaling, rows, in, out, rank, nslots, num_threads);
    else
        lora_rows<kBFloat16>(x, x_stride, y, y_stride, a, a_stride_s, a_stride_r, b, b_stride_s, b_stride_n, slots,
                             scaling, rows, in, out, rank, nslots, num_threads);
    return 0;
}
