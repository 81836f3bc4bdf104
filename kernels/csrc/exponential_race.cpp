// Sampling by the exponential race for CPU tensors: per row, the token argmax_i p_i / E_i, where
// p_i = exp((x_i - max x) * inv_temperature) and E_i = -log(1 - w_i) ~ Exp(1). The winner is token
// i with probability p_i / sum(p): the same law as a draw from softmax(x * inv_temperature).
// Masked tokens (x = -inf) have p = 0 and never win.
//
// The noise is counter-based, as kernels/sampling.py's reference draws it: w_i comes from the top
// 32 bits of SplitMix64's output function applied to key + (i + 1) * golden, so a row's noise is a
// function of its 64-bit key alone (the caller draws one key per row from the request's own
// generator), and the same key gives the same token in any batch.
//
// Most tokens cannot win, and the kernel proves it cheaply: E_i >= w_i, so p_i / E_i > best needs
// w_i * best < p_i. Only the lanes passing that test (a few per row) get the exact score, computed
// in double as the reference does; the rest cost a hash, an exp and a compare, 16 lanes at a time.

#include <cmath>

#include "baton_cpu.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#endif

using namespace baton;

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
// Attempt a's counters start a * 2^32 further on: disjoint from every other attempt's.
constexpr uint64_t kRetryStride = kGolden << 32;
constexpr float kTwoPowMinus32 = 2.3283064365386963e-10f;
// The cheap test must let through every lane the exact score could accept: exp_nonpositive is
// within 2e-7 of exp and the products round, so it runs with this much slack.
constexpr float kSlack = 1.0f + 1e-5f;

inline uint32_t noise_bits(uint64_t key, int64_t i) {
    uint64_t z = key + uint64_t(i + 1) * kGolden;
    z = (z ^ (z >> 30)) * kMix1;
    z = (z ^ (z >> 27)) * kMix2;
    z ^= z >> 31;
    return uint32_t(z >> 32);
}

typedef uint64_t v8q __attribute__((vector_size(64)));
typedef uint32_t v8w __attribute__((vector_size(32)));

// noise_bits for lanes i0 .. i0 + 15, as 16 floats k (exact for the small k that matter).
inline v16 noise_floats(uint64_t key, int64_t i0) {
    const v8q lane = {1, 2, 3, 4, 5, 6, 7, 8};
    v8q z[2];
    for (int h = 0; h < 2; ++h) {
        v8q x = key + (uint64_t(i0 + 8 * h) + lane) * kGolden;
        x = (x ^ (x >> 30)) * kMix1;
        x = (x ^ (x >> 27)) * kMix2;
        x ^= x >> 31;
        z[h] = x >> 32;
    }
    const v8w lo = __builtin_convertvector(z[0], v8w), hi = __builtin_convertvector(z[1], v8w);
    const v16w bits = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_convertvector(bits, v16);
}

// Bit l set when lane l of `a < b`.
inline uint32_t lanes_below(v16 a, v16 b) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    __m512 va, vb;
    __builtin_memcpy(&va, &a, sizeof va);
    __builtin_memcpy(&vb, &b, sizeof vb);
    return _mm512_cmp_ps_mask(va, vb, _CMP_LT_OQ);
#else
    uint32_t mask = 0;
    for (int l = 0; l < 16; ++l) mask |= uint32_t(a[l] < b[l]) << l;
    return mask;
#endif
}

struct Race {
    const float* x;
    double m, inv_t;
    uint64_t key;
    double best = -1.0;
    int64_t winner = 0;

    // The exact score of token i, in double (the reference's arithmetic).
    void try_token(int64_t i) {
        if (!(x[i] > -INFINITY)) return;
        const double w = (double(noise_bits(key, i)) + 0.5) * 2.3283064365386963e-10;
        const double score = std::exp((double(x[i]) - m) * inv_t) / -std::log1p(-w);
        if (score > best || (score == best && i < winner)) {
            best = score;
            winner = i;
        }
    }
};

// Sum of exp((x_i - m) * inv_t) over the tokens with x_i > above (strictly) and x_i >= floor:
// float lanes, flushed into a double every 1,024 tokens so a long row keeps ~1e-7 relative error.
double mass(const float* x, int64_t V, float m, float inv_t, float above, float floor) {
    const v16 vm = v16{} + m, vt = v16{} + inv_t, va = v16{} + above, vf = v16{} + floor;
    double total = 0.0;
    int64_t i = 0;
    while (i + 16 <= V) {
        v16 acc = {};
        const int64_t stop = i + 1024 < V ? i + 1024 : V;
        for (; i + 16 <= stop; i += 16) {
            const v16 v = load(x + i);
            const v16 e = exp_nonpositive((v - vm) * vt);
            acc += (v > va) & (v >= vf) ? e : v16{};
        }
        for (int l = 0; l < 16; ++l) total += acc[l];
    }
    for (; i < V; ++i)
        if (x[i] > above && x[i] >= floor) total += std::exp((double(x[i]) - m) * inv_t);
    return total;
}

// One race over the tokens with x >= floor (the row's max m always qualifies).
int64_t race(const float* x, int64_t V, float m, int64_t arg, float inv_t, uint64_t key, float floor) {
    Race r{x, double(m), double(inv_t), key};
    r.try_token(arg);  // the likeliest token first: `best` starts high and the cheap test bites at once
    const v16 vm = v16{} + m, vt = v16{} + inv_t, vf = v16{} + floor;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        const v16 v = load(x + i);
        const v16 p = v >= vf ? exp_nonpositive((v - vm) * vt) * kSlack : v16{};
        const v16 w = (noise_floats(key, i) + 0.5f) * kTwoPowMinus32;
        uint32_t hits = lanes_below(w * float(r.best), p);
        while (hits) {
            const int l = __builtin_ctz(hits);
            hits &= hits - 1;
            r.try_token(i + l);
        }
    }
    for (; i < V; ++i)
        if (x[i] >= floor) r.try_token(i);
    return r.winner;
}

struct Cuts {
    float top_k_floor;   // tokens below it are out of the distribution (-inf: no top-k)
    float min_p_offset;  // race only tokens with x >= max + offset (-inf: no min-p)
    float top_p;         // >= 1: no top-p
};

// See baton_exponential_race. Returns the token, or -1 when top-p rejected every attempt.
int64_t sample_row(const float* x, int64_t V, float inv_t, uint64_t key, Cuts c, int attempts) {
    // The row's max, 16 lanes at a time, then where it first occurs.
    v16 vmax = v16{} - INFINITY;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        const v16 v = load(x + i);
        vmax = v > vmax ? v : vmax;
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; ++l) m = vmax[l] > m ? vmax[l] : m;
    for (; i < V; ++i) m = x[i] > m ? x[i] : m;
    if (!(m > -INFINITY)) return 0;  // every token masked: nothing to draw (the caller never asks)
    int64_t arg = 0;
    while (arg < V && !(x[arg] == m)) ++arg;
    const float floor = c.min_p_offset > -INFINITY && m + c.min_p_offset > c.top_k_floor ? m + c.min_p_offset
                                                                                         : c.top_k_floor;
    if (!(c.top_p < 1.0f)) return race(x, V, m, arg, inv_t, key, floor);
    const double total = mass(x, V, m, inv_t, -INFINITY, c.top_k_floor);
    for (int a = 0; a < attempts; ++a) {
        const int64_t t = race(x, V, m, arg, inv_t, key + uint64_t(a) * kRetryStride, floor);
        // Inside the nucleus: the mass of the tokens above it is under top_p.
        if (mass(x, V, m, inv_t, x[t], c.top_k_floor) < double(c.top_p) * total) return t;
    }
    return -1;
}

}  // namespace

// logits [rows, V] float32 (row stride given, unit stride over V), inv_temperature [rows] float32,
// keys [rows] (64-bit), and per row the cuts: top_k_floor (the k-th largest logit), min_p_offset
// (temperature * log(min_p)) and top_p, each float32 [rows] or null for none. Tokens below the
// top-k floor are out; the race runs over those also at or above max + min_p_offset; a top-p row
// keeps its token when the tokens above it (among those top-k kept) hold under top_p of the mass,
// else races again with its next attempt's noise, `attempts` times at most. out [rows] int64
// gets the tokens, -1 for a row whose every attempt fell outside its nucleus. Returns 0, or 1 for
// bad arguments.
extern "C" int baton_exponential_race(const float* logits, int64_t stride, int64_t rows, int64_t V,
                                      const float* inv_temperature, const uint64_t* keys,
                                      const float* top_k_floor, const float* min_p_offset, const float* top_p,
                                      int attempts, int64_t* out, int num_threads) {
    if (rows < 0 || V <= 0 || stride < V || attempts < 1) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const Cuts c{top_k_floor ? top_k_floor[r] : -INFINITY, min_p_offset ? min_p_offset[r] : -INFINITY,
                     top_p ? top_p[r] : 1.0f};
        out[r] = sample_row(logits + r * stride, V, inv_temperature[r], keys[r], c, attempts);
    }
    return 0;
}
