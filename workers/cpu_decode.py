"""Decode steps on the CPU through kernels.decode_layers: the decoder layers in one native call.

`cpu_decode_layers` builds a DecodeLayers for a model runner when every layer runs exactly what
that call runs (a Llama-family model in float32 on the native kernels, its projections packed for
small_m_linear, no biases or q/k norms, a float32 KV cache, one rank), and says why not otherwise.
The model runner (workers/model_runner.py) then sends decode-only steps through `decode_hidden`
and every other step (a prefill chunk, a speculative verify) through the model's own forward pass;
`--enforce-eager` keeps every step on the latter.
"""

from __future__ import annotations

import torch

from kernels.decode_layers import DecodeGeometry, DecodeLayers, DecodeLayerWeights, entry_points
from workers.models.llama import LlamaForCausalLM
from workers.packed_linear import PackedLinear


def _packed(linear) -> torch.Tensor | None:
    """The small_m_linear packing of a bias-free projection, else None."""
    if not isinstance(linear, PackedLinear) or linear.bias is not None or linear.packed_weight.dim() != 3:
        return None
    return linear.packed_weight


def unsupported_reason(model, kv_cache: torch.Tensor, tp_group) -> str | None:
    """Why the model's decode steps cannot run through DecodeLayers; None when they can."""
    if type(model) is not LlamaForCausalLM:  # subclasses (Gemma) change the norms or the MLP
        return f"{type(model).__name__} is not a plain Llama-family model"
    if tp_group is not None:
        return "tensor parallelism all-reduces between the layers"
    if model.ops.backend != "native" or kv_cache.device.type != "cpu":
        return "the native CPU kernels are not in use"
    if kv_cache.dtype != torch.float32 or model.embed_tokens.weight.dtype != torch.float32:
        return f"the weights or the KV cache ({kv_cache.dtype}) are not float32"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return "per-head q/k norms"
        if any(_packed(p) is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "a projection with a bias or not packed for small_m_linear"
    if entry_points() is None:
        return "the native decode kernels are not built"
    return None


def cpu_decode_layers(model, kv_cache: torch.Tensor, tp_group=None) -> DecodeLayers | None:
    """DecodeLayers over the model's layers and its [layers, 2, blocks, block_size, heads,
    head_dim] KV cache, or None (see unsupported_reason)."""
    if unsupported_reason(model, kv_cache, tp_group) is not None:
        return None
    first = model.layers[0]
    geometry = DecodeGeometry(
        hidden_size=model.config.hidden_size, intermediate_size=model.config.intermediate_size,
        num_heads=first.self_attn.num_heads, num_kv_heads=first.self_attn.num_kv_heads,
        head_dim=first.self_attn.head_dim, eps=first.eps, scale=first.self_attn.scale, softcap=first.self_attn.softcap)
    layers = [DecodeLayerWeights(
        input_norm=layer.input_layernorm.data, qkv=_packed(layer.self_attn.qkv_proj), o=_packed(layer.self_attn.o_proj),
        post_norm=layer.post_attention_layernorm.data, gate_up=_packed(layer.mlp.gate_up_proj),
        down=_packed(layer.mlp.down_proj), k_cache=kv_cache[i, 0], v_cache=kv_cache[i, 1], window=layer.self_attn.window)
        for i, layer in enumerate(model.layers)]
    return DecodeLayers(geometry, layers, model.cos_sin_cache)


def decode_hidden(model, layers: DecodeLayers, input_ids: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """The model's final hidden states [B, hidden] (normed) for B decode rows, as model.forward
    returns them."""
    hidden, residual = layers.run(model.embed_tokens(input_ids), positions, slot_mapping, block_tables, context_lens,
                                  torch.get_num_threads())
    hidden, _ = model.ops.rms_norm(hidden, model.norm, model.config.rms_norm_eps, residual)
    return hidden
