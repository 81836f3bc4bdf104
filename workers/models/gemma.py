"""Gemma 2 and Gemma 3 (text) on the paged KV cache, built from llama.py's pieces.

What differs from the Llama family (the ModelConfig fields in brackets):
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype as transformers does;
- GeGLU MLP: gelu_tanh(gate) * up (KernelOps.gelu_tanh_and_mul) [hidden_act];
- four RMSNorms per layer, before and after attention and the MLP; Gemma's norm multiplies by
  (1 + w), so each norm weight is loaded as 1 + w, kept in float32 whatever the model dtype, into
  the ordinary rms_norm op (which scales in float32, then rounds: exactly Gemma's order);
- attention scaled by query_pre_attn_scalar^-1/2 [query_pre_attn_scalar]; sliding-window layers
  alternating with global ones [layer_windows], windows and Gemma 2's attention logit soft-cap
  applied inside the attention kernels [attn_logit_softcap]; Gemma 2's final logit soft-cap
  [final_logit_softcap];
- Gemma 3: per-head q/k RMSNorm [qk_norm], and a separate rope base for the sliding layers
  [local_rope_theta]: two rope tables, each layer reading its own.

The residual stream is carried as (delta, residual) like llama.py, so each add is fused into the
norm that follows it: the sums are the same float additions transformers does, in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import KernelOps
from workers.models.config import ModelConfig
from workers.models.llama import MLP, Attention, AttentionMetadata, KVCacheView, LlamaForCausalLM

NORM_SUFFIXES = ("layernorm", "q_norm", "k_norm")


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, layer: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.ops = ops
        self.sliding = config.layer_window(layer) is not None
        self.self_attn = Attention(config, ops, config.layer_window(layer))
        self.mlp = GemmaMLP(config, ops)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, nn.Parameter(torch.ones(config.hidden_size)))

    def forward(self, hidden, residual, positions, cos_sin_cache, meta, kv):
        """(delta, residual) in, where the stream is delta + residual (residual None: delta is it)."""
        norm = self.ops.rms_norm
        if residual is None:
            residual = hidden
            hidden = norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = norm(hidden, self.input_layernorm, self.eps, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, meta, kv)
        hidden = norm(hidden, self.post_attention_layernorm, self.eps)
        hidden, residual = norm(hidden, self.pre_feedforward_layernorm, self.eps, residual)
        hidden = norm(self.mlp(hidden), self.post_feedforward_layernorm, self.eps)
        return hidden, residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text); weights load through llama.py's loader."""

    def __init__(self, config: ModelConfig, ops: KernelOps) -> None:
        super().__init__(config, ops)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, i) for i in range(config.num_layers))
        # Gemma 3's sliding layers' rope table (load_model fills it); empty: every layer reads cos_sin_cache.
        self.local_cos_sin_cache = torch.empty(0)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_layers: list[KVCacheView]) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] (normed)."""
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(
            self.config.hidden_size**0.5, dtype=weight.dtype, device=weight.device
        )
        local = self.local_cos_sin_cache if self.local_cos_sin_cache.numel() else self.cos_sin_cache
        residual = None
        for layer, kv in zip(self.layers, kv_layers):
            rope = local if layer.sliding else self.cos_sin_cache
            hidden, residual = layer(hidden, residual, positions, rope, meta, kv)
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), transformers' order of operations
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_hf_weights(self, weights, quant=None) -> None:
        """llama.py's loader (FP8 checkpoints too), then every norm weight w becomes 1 + w in float32
        (Gemma's RMSNorm)."""
        super().load_hf_weights(weights, quant)
        for name, param in self.named_parameters():
            if name == "norm" or name.rsplit(".", 1)[-1].endswith(NORM_SUFFIXES):
                param.data = param.data.float() + 1.0
