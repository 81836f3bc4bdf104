// The decoder layers of a float32 step, run as one call: the same native kernels, in the same
// order and with the same arguments as the model's layer-by-layer forward pass, without a trip
// through Python between them (see kernels/layer_stack.py).
//
// The kernels are not linked in: each lives in its own library, and the caller passes their entry
// points (StackKernels), so a layer runs exactly the code the layer-by-layer pass runs.
#include <cstdint>

namespace {

using RmsNormFn = int (*)(const void* x, int64_t x_stride, const void* residual, int64_t r_stride,
                          const void* weight, int w_dtype, void* out, int64_t out_stride,
                          void* sum_out, int64_t sum_stride, int64_t T, int64_t H, float eps, int dtype,
                          int num_threads);
using LinearFn = int (*)(const float* x, int64_t x_stride, int64_t M, const float* w_packed, float* y,
                         int64_t y_stride, int64_t K, int64_t N, int num_threads);
using AmxLinearFn = int (*)(const float* x, int64_t x_stride, int64_t M, const uint16_t* w_tiles, float* y,
                            int64_t y_stride, int64_t K, int64_t N, int num_threads);
using RotaryFn = int (*)(const int64_t* positions, void* q, int64_t q_stride_t, int64_t q_stride_h, int Hq,
                         void* k, int64_t k_stride_t, int64_t k_stride_h, int Hk, int D,
                         const float* cos_sin, int64_t max_position, int64_t T, int dtype, int num_threads);
using StoreKvFn = int (*)(const char* key, int64_t k_stride_t, int64_t k_stride_h,
                          const char* value, int64_t v_stride_t, int64_t v_stride_h,
                          char* k_cache, char* v_cache, const int64_t* slots, int64_t T, int Hk, int D,
                          int64_t num_slots, int elem_size);
using DecodeAttentionFn = int (*)(const void* q, int64_t q_stride_b, int64_t q_stride_h, int q_dtype,
                                  const void* k_cache, const void* v_cache, int kv_dtype, int64_t num_blocks,
                                  const float* k_fp8_table, const float* v_fp8_table,
                                  const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks_per_seq,
                                  const int32_t* context_lens, void* out, int64_t out_stride_b, int64_t out_stride_h,
                                  int64_t B, int Hq, int Hk, int D, int block_size,
                                  float scale, int64_t window, float softcap, int num_threads);
using PrefillAttentionFn = int (*)(const void* q, int64_t q_stride_t, int64_t q_stride_h, int q_dtype,
                                   const void* k_cache, const void* v_cache, int kv_dtype, int64_t num_blocks,
                                   const float* k_fp8_table, const float* v_fp8_table,
                                   const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks_per_seq,
                                   const int32_t* query_start_loc, const int32_t* context_lens,
                                   void* out, int64_t out_stride_t, int64_t out_stride_h,
                                   int64_t B, int Hq, int Hk, int D, int block_size, float scale, int64_t window,
                                   float softcap, int num_threads);
using SiluMulFn = int (*)(const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t T,
                          int64_t inter, int dtype, int num_threads);
using LoraAddFn = int (*)(const void* x, int64_t x_stride, void* y, int64_t y_stride, const void* a,
                          int64_t a_stride_s, int64_t a_stride_r, const void* b, int64_t b_stride_s,
                          int64_t b_stride_n, const int64_t* slots, const float* scaling, int64_t rows,
                          int64_t in, int64_t out, int64_t rank, int64_t nslots, int dtype, int num_threads);

// LoRA targets, in the order of StackLayer's lora_a / lora_b (common/lora.py LORA_TARGETS).
enum LoraTarget { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kNumLoraTargets };

constexpr int kFloat32 = 0;  // kernels/cpu_native.py DTYPE_CODES

}  // namespace

extern "C" {

struct StackKernels {
    RmsNormFn rms_norm;
    LinearFn linear;
    RotaryFn rotary;
    StoreKvFn store_kv;
    DecodeAttentionFn decode_attention;
    PrefillAttentionFn prefill_attention;
    SiluMulFn silu_and_mul;
    AmxLinearFn amx_linear;  // null: every row on `linear`
    LoraAddFn lora_add;      // null: no LoRA (a step with lora_rows is then refused)
};

// One layer's weights (float32; the projections packed by kernels/small_m_linear.py) and KV cache.
struct StackLayer {
    const float* input_norm;
    const float* qkv;
    const float* o;
    const float* post_norm;
    const float* gate_up;
    const float* down;
    char* k_cache;
    char* v_cache;
    int64_t window;  // 0: full attention
    // The projections split for amx_linear (kernels/amx_linear.py), or all null: prompt rows then
    // run on `linear` too.
    const uint16_t* qkv_tiles;
    const uint16_t* o_tiles;
    const uint16_t* gate_up_tiles;
    const uint16_t* down_tiles;
    // LoRA adapters' stacked matrices per target (workers/lora/manager.py): A [slots, rank, in],
    // B [slots, out, rank] float32, or null where the stack has no LoRA.
    const float* lora_a[kNumLoraTargets];
    const float* lora_b[kNumLoraTargets];
};

struct StackShapes {
    int64_t hidden, intermediate;
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_blocks;        // of each layer's cache
    const float* cos_sin;      // the rotary cache [max_position, head_dim]
    int64_t max_position;
    float eps, scale, softcap;  // softcap 0: none
    int64_t lora_rank, lora_slots;  // of the LoRA stacks (0: none)
};

// One step's batch and its buffers. The batch's T tokens hold one token of each of the first
// num_decode sequences (decode rows), then the chunks of num_prefill more sequences (prefill rows,
// chunk i being tokens [query_start[i], query_start[i + 1]) counted from the first prefill row), as
// in workers/models/llama.py's AttentionMetadata. Buffers are float32 with unit row strides:
// hidden [T, hidden] (the embeddings on entry, the last layer's MLP output on return), residual
// [T, hidden] (the residual stream on return), normed [T, hidden], qkv [T, q + 2 kv], attn [T, q],
// gate_up [T, 2 intermediate], act [T, intermediate]. prompt_runs: num_prompt_runs [start, end) row
// ranges, rising and apart, of tokens in their sequence's prompt, which amx_linear projects where
// the layer has tiles; every other row (decode rows, speculative drafts) stays on `linear`.
struct StackStep {
    int64_t T;
    const int64_t* positions;
    const int64_t* slots;
    int64_t num_decode;
    const int32_t* decode_block_tables;  // [num_decode, decode_width]
    int64_t decode_width;
    const int32_t* decode_context_lens;
    int64_t num_prefill;
    const int32_t* prefill_block_tables;  // [num_prefill, prefill_width]
    int64_t prefill_width;
    const int32_t* prefill_query_start;  // [num_prefill + 1]
    const int32_t* prefill_context_lens;  // each sequence's tokens, its chunk included
    float* hidden;
    float* residual;
    float* normed;
    float* qkv;
    float* attn;
    float* gate_up;
    float* act;
    const int64_t* prompt_runs;  // [num_prompt_runs, 2]
    int64_t num_prompt_runs;
    // LoRA: each row's adapter slot (-1: the base model), or null for a step without adapters; the
    // slots' scalings; the targets any slot in use adapts (bit t for LoraTarget t).
    const int64_t* lora_rows;
    const float* lora_scaling;
    int64_t lora_targets;
};

// Returns 0, or 1000 * (layer + 1) + 10 * stage + the kernel's own status (1 or 2) for the first
// kernel that refuses (stage: 1 input norm, 2 qkv, 3 rotary, 4 KV store, 5 decode attention,
// 6 prefill attention, 7 o, 8 post-attention norm, 9 gate_up, 10 SiLU-and-mul, 11 down, 12 LoRA
// of q/k/v, 13 LoRA of o, 14 LoRA of gate/up, 15 LoRA of down); the step's later kernels do not
// run. A projection's LoRA update is added right after it, as workers/lora/layers.py adds it.
int baton_layer_stack(const StackKernels* k, const StackLayer* layers, int num_layers, const StackShapes* s,
                      const StackStep* st, int num_threads) {
    // B: the step's tokens (rows of every buffer); nd: its decode rows, the first of them.
    const int64_t B = st->T, H = s->hidden, I = s->intermediate, D = s->head_dim, nd = st->num_decode;
    const int Hq = s->num_heads, Hk = s->num_kv_heads;
    const int64_t q_size = Hq * D, kv_size = Hk * D, qkv_width = q_size + 2 * kv_size;
    float* k_rows = st->qkv + q_size;
    float* v_rows = k_rows + kv_size;
    const int64_t num_slots = s->num_blocks * s->block_size;
    // y = x . W^T over the step's rows: the prompt runs on amx_linear when there are tiles, the rows
    // between them on `linear`. Both give each row the same bits whatever rows run beside it.
    auto project = [&](const float* x, int64_t xs, const float* w, const uint16_t* tiles, float* y, int64_t ys,
                       int64_t K, int64_t N) {
        if (tiles == nullptr || k->amx_linear == nullptr || st->num_prompt_runs == 0)
            return k->linear(x, xs, B, w, y, ys, K, N, num_threads);
        int64_t row = 0;
        for (int64_t r = 0; r <= st->num_prompt_runs; ++r) {
            const int64_t start = r < st->num_prompt_runs ? st->prompt_runs[2 * r] : B;
            if (start > row) {
                if (int status = k->linear(x + row * xs, xs, start - row, w, y + row * ys, ys, K, N, num_threads))
                    return status;
            }
            if (r == st->num_prompt_runs) break;
            const int64_t end = st->prompt_runs[2 * r + 1];
            if (int status = k->amx_linear(x + start * xs, xs, end - start, tiles, y + start * ys, ys, K, N, num_threads))
                return status;
            row = end;
        }
        return 0;
    };
    // y[r, :out] += scaling[s] * B[s] @ (A[s] @ x[r]) for rows r of slot s >= 0 (kernels/lora.py).
    auto lora = [&](const StackLayer& w, int target, const float* x, int64_t xs, float* y, int64_t ys, int64_t in,
                    int64_t out) {
        if (st->lora_rows == nullptr || !(st->lora_targets >> target & 1)) return 0;
        if (k->lora_add == nullptr || w.lora_a[target] == nullptr || w.lora_b[target] == nullptr) return 3;
        const int64_t r = s->lora_rank;
        return k->lora_add(x, xs, y, ys, w.lora_a[target], r * in, in, w.lora_b[target], out * r, r, st->lora_rows,
                           st->lora_scaling, B, in, out, r, s->lora_slots, kFloat32, num_threads);
    };
    for (int l = 0; l < num_layers; ++l) {
        const StackLayer& w = layers[l];
        int status = 0, stage = 0;
        // Each stage runs only while every earlier one succeeded.
        auto then = [&](int at, auto&& call) {
            if (status == 0) stage = at, status = call();
        };
        then(1, [&] {
            if (l > 0)  // later layers add their input to the residual stream
                return k->rms_norm(st->hidden, H, st->residual, H, w.input_norm, kFloat32, st->normed, H,
                                   st->residual, H, B, H, s->eps, kFloat32, num_threads);
            for (int64_t i = 0; i < B * H; ++i) st->residual[i] = st->hidden[i];  // the first layer's input is it
            return k->rms_norm(st->hidden, H, nullptr, 0, w.input_norm, kFloat32, st->normed, H, nullptr, 0, B, H,
                               s->eps, kFloat32, num_threads);
        });
        then(2, [&] { return project(st->normed, H, w.qkv, w.qkv_tiles, st->qkv, qkv_width, H, qkv_width); });
        then(12, [&] {
            int st_q = lora(w, kQ, st->normed, H, st->qkv, qkv_width, H, q_size);
            if (st_q) return st_q;
            int st_k = lora(w, kK, st->normed, H, k_rows, qkv_width, H, kv_size);
            return st_k ? st_k : lora(w, kV, st->normed, H, v_rows, qkv_width, H, kv_size);
        });
        then(3, [&] {
            return k->rotary(st->positions, st->qkv, qkv_width, D, Hq, k_rows, qkv_width, D, Hk, int(D), s->cos_sin,
                             s->max_position, B, kFloat32, num_threads);
        });
        then(4, [&] {
            return k->store_kv(reinterpret_cast<const char*>(k_rows), qkv_width, D,
                               reinterpret_cast<const char*>(v_rows), qkv_width, D, w.k_cache, w.v_cache, st->slots, B,
                               Hk, int(D), num_slots, int(sizeof(float)));
        });
        then(5, [&] {
            if (nd == 0) return 0;
            return k->decode_attention(st->qkv, qkv_width, D, kFloat32, w.k_cache, w.v_cache, kFloat32, s->num_blocks,
                                       nullptr, nullptr, st->decode_block_tables, st->decode_width, st->decode_width,
                                       st->decode_context_lens, st->attn, q_size, D, nd, Hq, Hk, int(D),
                                       s->block_size, s->scale, w.window, s->softcap, num_threads);
        });
        then(6, [&] {
            if (st->num_prefill == 0) return 0;
            return k->prefill_attention(st->qkv + nd * qkv_width, qkv_width, D, kFloat32, w.k_cache, w.v_cache,
                                        kFloat32, s->num_blocks, nullptr, nullptr, st->prefill_block_tables,
                                        st->prefill_width, st->prefill_width, st->prefill_query_start,
                                        st->prefill_context_lens, st->attn + nd * q_size, q_size, D, st->num_prefill,
                                        Hq, Hk, int(D), s->block_size, s->scale, w.window, s->softcap, num_threads);
        });
        then(7, [&] { return project(st->attn, q_size, w.o, w.o_tiles, st->hidden, H, q_size, H); });
        then(13, [&] { return lora(w, kO, st->attn, q_size, st->hidden, H, q_size, H); });
        then(8, [&] {
            return k->rms_norm(st->hidden, H, st->residual, H, w.post_norm, kFloat32, st->normed, H, st->residual, H,
                               B, H, s->eps, kFloat32, num_threads);
        });
        then(9, [&] { return project(st->normed, H, w.gate_up, w.gate_up_tiles, st->gate_up, 2 * I, H, 2 * I); });
        then(14, [&] {
            int st_gate = lora(w, kGate, st->normed, H, st->gate_up, 2 * I, H, I);
            return st_gate ? st_gate : lora(w, kUp, st->normed, H, st->gate_up + I, 2 * I, H, I);
        });
        then(10, [&] { return k->silu_and_mul(st->gate_up, 2 * I, st->act, I, B, I, kFloat32, num_threads); });
        then(11, [&] { return project(st->act, I, w.down, w.down_tiles, st->hidden, H, I, H); });
        then(15, [&] { return lora(w, kDown, st->act, I, st->hidden, H, I, H); });
        if (status != 0) return 1000 * (l + 1) + 10 * stage + status;
    }
    return 0;
}

}  // extern "C"
