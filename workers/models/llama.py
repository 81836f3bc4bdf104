"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2) on the paged KV cache.

One implementation serves all of them: they differ only in q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3), rope scaling (Llama 3, Phi-3's LongRoPE) and tied embeddings, which
ModelConfig records, plus sliding-window layers (Mistral, Phi-3, Qwen2's use_sliding_window: the
window goes to the attention kernels, ModelConfig.layer_windows). q/k/v and gate/up projections are
fused into one matrix each at load time
(Phi-3's checkpoints come fused), so a layer runs four matrix products instead of seven.
Every hot op is a function of the model's KernelOps (kernels.ops.kernel_ops), chosen once when
the model is built: Triton on CUDA, native C++ or PyTorch on the CPU.

Batch layout (see AttentionMetadata): the flat token batch holds the decode tokens first (one per
sequence), then the new tokens of each prefilling sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from kernels.ops import KernelOps
from workers.models.config import ModelConfig
from workers.quantization import packed_linear


class AllReduce(Protocol):
    """What a model needs of its tensor-parallel group (workers.parallel.group.TPGroup): the sum of
    every rank's partial output, which row-parallel o_proj and down_proj leave."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch reads and writes KV.

    slot_mapping[t]: cache slot (block_id * block_size + offset) receiving token t's K/V.
    The first num_decode_tokens tokens belong to decoding sequences (one each), described by
    decode_block_tables / decode_context_lens. The rest are prefill chunks of the sequences in
    prefill_block_tables, split by prefill_query_start_loc; prefill_context_lens counts each
    sequence's tokens including the chunk.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_context_lens: torch.Tensor

    @classmethod
    def one_prompt(cls, n: int, num_blocks: int, device: torch.device | str) -> AttentionMetadata:
        """A batch of one n-token prompt from its first token, in blocks 0..num_blocks-1, slot t for
        token t (a profiling or calibration pass over a scratch cache)."""
        i32 = torch.int32
        return cls(
            slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 0), dtype=i32, device=device),
            decode_context_lens=torch.zeros((0,), dtype=i32, device=device),
            prefill_block_tables=torch.arange(num_blocks, dtype=i32, device=device).reshape(1, num_blocks),
            prefill_query_start_loc=torch.tensor([0, n], dtype=i32, device=device),
            prefill_context_lens=torch.tensor([n], dtype=i32, device=device),
        )


@dataclass
class KVCacheView:
    """One layer's paged K and V ([num_blocks, block_size, num_kv_heads, head_dim] each) and FP8 scales."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, ops: KernelOps, window: int | None = None, tp_group: AllReduce | None = None
    ) -> None:
        super().__init__()
        self.ops = ops
        # With tensor parallelism config is the rank's shard (its heads) and o_proj's partial sums are all-reduced.
        self.tp_group = tp_group
        # Sliding window (tokens a query sees, itself included) and Gemma 2's logit soft-cap, both
        # applied inside the attention kernels; None: full causal attention, uncapped.
        self.window = window
        self.softcap = config.attn_logit_softcap
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.eps = config.rms_norm_eps
        self.q_norm = nn.Parameter(torch.ones(config.head_dim)) if config.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(config.head_dim)) if config.qk_norm else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCacheView,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        ops = self.ops
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view(
                num_tokens, self.num_heads, self.head_dim
            )
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view(
                num_tokens, self.num_kv_heads, self.head_dim
            )
        ops.rotary_embedding(positions, q, k, cos_sin_cache)
        ops.store_kv(k, v, kv.k_cache, kv.v_cache, meta.slot_mapping, kv.k_scale, kv.v_scale)
        nd = meta.num_decode_tokens
        if nd == num_tokens:
            out = ops.paged_decode_attention(
                q,
                kv.k_cache,
                kv.v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                kv.k_scale,
                kv.v_scale,
                window=self.window,
                softcap=self.softcap,
            )
        else:
            out = torch.empty_like(q)
            if nd:
                out[:nd] = ops.paged_decode_attention(
                    q[:nd],
                    kv.k_cache,
                    kv.v_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    kv.k_scale,
                    kv.v_scale,
                    window=self.window,
                    softcap=self.softcap,
                )
            out[nd:] = ops.paged_prefill_attention(
                q[nd:],
                kv.k_cache,
                kv.v_cache,
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_context_lens,
                self.scale,
                kv.k_scale,
                kv.v_scale,
                window=self.window,
                softcap=self.softcap,
            )
        out = self.o_proj(out.view(num_tokens, self.q_size))
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp_group: AllReduce | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.tp_group = tp_group  # as in Attention: down_proj's partial sums are all-reduced
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp_group is None else self.tp_group.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, layer: int = 0, tp_group: AllReduce | None = None) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.ops = ops
        self.self_attn = Attention(config, ops, config.layer_window(layer), tp_group)
        self.mlp = MLP(config, ops, tp_group)
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, hidden, residual, positions, cos_sin_cache, meta, kv):
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = self.ops.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, meta, kv)
        hidden, residual = self.ops.rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp_group: AllReduce | None = None) -> None:
        """tp_group: this rank's tensor-parallel group, config then being its shard
        (workers.parallel.sharding.ShardPlan.model_config); None: the whole model."""
        super().__init__()
        self.config = config
        self.ops = ops  # the kernels every layer calls (kernels.ops.kernel_ops)
        # Given its (empty) weight, the embedding skips its random init: that init's normal_ imports
        # torch._dynamo under the meta device (1.6 s of CPU at every start), and the checkpoint overwrites it.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, ops, i, tp_group) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        )
        # float32 [max_positions, head_dim]; the model runner fills it for its context length.
        self.cos_sin_cache = torch.empty(0)
        # oneDNN-packed copy of the lm_head on CPU (workers.quantization.packed_linear.prepack), else None.
        self.packed_lm_head: torch.Tensor | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_layers: list[KVCacheView]) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] (normed)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.layers, kv_layers):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, meta, kv)
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return packed_linear.packed_linear(hidden, self.packed_lm_head, None).float()
        return F.linear(hidden, self.lm_head_weight).float()

    # ---- weights -------------------------------------------------------------------------
    def load_hf_weights(self, weights, quant=None) -> None:
        """Load (name, tensor) pairs with Hugging Face names, fusing q/k/v and gate/up.

        quant (workers.quantization.fp8.CheckpointQuantization) describes a pre-quantized FP8
        checkpoint; its linear layers must already be Fp8Linear (see prepare_for_checkpoint).
        Each projection's scale (`weight_scale`, or `weight_scale_inv` in the HF fp8 format, which
        multiplies despite its name) lands in the rows of the fused matrix its weight fills.
        """
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0, q),
            "k_proj": ("self_attn.qkv_proj", q, kv),
            "v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "gate_proj": ("mlp.gate_up_proj", 0, inter),
            "up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def fused_pieces(pname: str) -> set[str]:
            """The row ranges of a fused parameter, as `put` records them; empty if not fused."""
            if pname.endswith(("qkv_proj.weight", "qkv_proj.bias", "qkv_proj.weight_scale")):
                return {f"{pname}[0]", f"{pname}[{q}]", f"{pname}[{q + kv}]"}
            if pname.endswith(("gate_up_proj.weight", "gate_up_proj.bias", "gate_up_proj.weight_scale")):
                return {f"{pname}[0]", f"{pname}[{inter}]"}
            return set()

        def put(name: str, tensor: torch.Tensor, start: int | None = None, size: int | None = None) -> None:
            if name not in params:
                raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
            target = params[name].data
            if start is not None:
                assert size is not None  # a slice comes with its start and its size
                target = target[start : start + size]
            if name.endswith("weight_scale"):
                in_features = self.get_submodule(name.rsplit(".", 1)[0]).in_features
                tensor = quant.expand_scale(tensor, target.shape[0], in_features, name)
            elif name.endswith("weight") and (tensor.dtype == torch.float8_e4m3fn) != (
                target.dtype == torch.float8_e4m3fn
            ):
                # Copying raw FP8 codes into a float weight (or the reverse) would load wrong values silently.
                raise ValueError(
                    f"checkpoint tensor for {name} is {tensor.dtype} but the model expects {target.dtype}; "
                    f"FP8 checkpoints need a quantization_config, and every linear layer must be quantized"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            if start is None and name.rsplit(".", 1)[0].endswith(("qkv_proj", "gate_up_proj")):
                loaded.update(fused_pieces(name))  # a checkpoint with fused projections (Phi-3)
            else:
                loaded.add(name if start is None else f"{name}[{start}]")

        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            name = hf_name.removeprefix("model.")
            # Static activation / KV scales of FP8 checkpoints: activations stay dynamic here, and
            # KV scales come from EngineConfig.kv_scales or calibration.
            if name.endswith(("input_scale", "k_scale", "v_scale", "output_scale")):
                continue
            if name.endswith(("weight_scale", "weight_scale_inv")):
                if quant is None:
                    raise ValueError(f"checkpoint has FP8 scale {hf_name} but config.json has no quantization_config")
                name = name.removesuffix("_inv")
            if name == "lm_head.weight":
                if self.lm_head is not None:
                    put("lm_head", tensor)
                continue
            if name == "norm.weight":
                put("norm", tensor)
                continue
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
                put(name.removesuffix(".weight"), tensor)
                continue
            parts = name.split(".")  # layers.{i}.{self_attn|mlp}.{proj}.{weight|bias|weight_scale}
            if len(parts) == 5 and parts[3] in fused:
                target, start, size = fused[parts[3]]
                put(f"layers.{parts[1]}.{target}.{parts[4]}", tensor, start, size)
                continue
            put(name, tensor)

        expected = set()
        for pname in params:
            expected |= fused_pieces(pname) or {pname}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
