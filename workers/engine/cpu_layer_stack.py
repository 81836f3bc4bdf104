"""Steps on the CPU through kernels.layer_stack: a float32 model's decoder layers in one native call.

`cpu_layer_stack` builds a LayerStack for a model runner when every layer runs exactly what that
call runs (a Llama-family model in float32 on the native kernels, its projections packed for
small_m_linear, no biases or q/k norms, a float32 KV cache, one rank), and `unsupported_reason`
says why not otherwise. The model runner (workers/engine/model_runner.py) then runs every step through
`stack_hidden` instead of the model's own forward pass; `--enforce-eager` keeps the latter.

With `float32_prompt_matmul="bf16x3"` on a CPU with AMX-BF16, the stack also holds each projection
split for kernels.amx_linear (4 bytes per weight), and the rows of prompt tokens are projected as
three bfloat16 products each (kernels/amx_linear.py says how close that is to float32); decode rows
and speculative drafts always run in float32.
"""

from __future__ import annotations

from typing import cast

import torch

from common.lora import LORA_TARGETS
from kernels import amx_linear
from kernels.layer_stack import LayerGeometry, LayerStack, LayerWeights, StackBatch, StackLoRA, entry_points
from workers.lora.manager import LoRAManager
from workers.models.llama import AttentionMetadata, DecoderLayer, LlamaForCausalLM
from workers.quantization.packed_linear import PackedLinear


def _packed(linear) -> torch.Tensor | None:
    """The small_m_linear packing of a bias-free projection, else None."""
    if not isinstance(linear, PackedLinear) or linear.bias is not None or linear.packed_weight.dim() != 3:
        return None
    return linear.packed_weight


def _decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    """The model's decoder layers (its nn.ModuleList gives them to the checker as plain modules)."""
    return [cast(DecoderLayer, layer) for layer in model.layers]


def unsupported_reason(model, kv_cache: torch.Tensor, tp_group) -> str | None:
    """Why the model's steps cannot run through LayerStack; None when they can."""
    if type(model) is not LlamaForCausalLM:  # subclasses (Gemma, MoE) change the norms or the MLP
        return f"{type(model).__name__} is not a plain Llama-family model"
    if tp_group is not None:
        return "tensor parallelism all-reduces between the layers"
    if model.ops.backend != "native" or kv_cache.device.type != "cpu":
        return "the native CPU kernels are not in use"
    if kv_cache.dtype != torch.float32 or model.embed_tokens.weight.dtype != torch.float32:
        return f"the weights or the KV cache ({kv_cache.dtype}) are not float32"
    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return "per-head q/k norms"
        if any(_packed(p) is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "a projection with a bias or not packed for small_m_linear"
    if entry_points() is None:
        return "the native kernels are not built"
    return None


def cpu_layer_stack(model, kv_cache: torch.Tensor, tp_group=None, prompt_matmul: str = "ieee") -> LayerStack | None:
    """LayerStack over the model's layers and its [layers, 2, blocks, block_size, heads, head_dim]
    KV cache, or None (see unsupported_reason). prompt_matmul "bf16x3" adds the AMX tiles where the
    kernel runs."""
    if unsupported_reason(model, kv_cache, tp_group) is not None:
        return None
    tiled = prompt_matmul == "bf16x3" and amx_linear.ready()
    first = model.layers[0]
    geometry = LayerGeometry(
        hidden_size=model.config.hidden_size,
        intermediate_size=model.config.intermediate_size,
        num_heads=first.self_attn.num_heads,
        num_kv_heads=first.self_attn.num_kv_heads,
        head_dim=first.self_attn.head_dim,
        eps=first.eps,
        scale=first.self_attn.scale,
        softcap=first.self_attn.softcap,
    )
    layers = []
    for i, layer in enumerate(model.layers):
        projections = {
            "qkv": layer.self_attn.qkv_proj,
            "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj,
        }
        packed: dict[str, torch.Tensor] = {}
        for name, p in projections.items():
            weight = _packed(p)
            assert weight is not None  # unsupported_reason found every projection packed
            packed[name] = weight
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.data,
                post_norm=layer.post_attention_layernorm.data,
                k_cache=kv_cache[i, 0],
                v_cache=kv_cache[i, 1],
                window=layer.self_attn.window,
                **packed,
                **{f"{name}_tiles": amx_linear.pack_weight(w) for name, w in packed.items() if tiled},
            )
        )
    return LayerStack(geometry, layers, model.cos_sin_cache)


def attach_stack_lora(stack: LayerStack, manager: LoRAManager) -> None:
    """Let the stack run steps with adapter rows, on the manager's device slots (written in place
    as adapters move in and out). A stack whose LoRA kernel did not build keeps such steps on the
    layer-by-layer pass."""
    if manager.dtype != torch.float32 or manager.device.type != "cpu":
        return
    layers = range(manager.config.num_layers)
    stack.attach_lora(
        StackLoRA(
            [{t: manager.a[(i, t)] for t in LORA_TARGETS} for i in layers],
            [{t: manager.b[(i, t)] for t in LORA_TARGETS} for i in layers],
            manager.scaling,
        )
    )


def stack_lora_rows(manager: LoRAManager) -> tuple[torch.Tensor, int]:
    """The step's adapter rows as the stack takes them: the manager's int64 slots [T] (set for the
    step by the model runner) and its active targets as a bitmask."""
    assert manager.row_slots is not None
    mask = sum(1 << i for i, t in enumerate(LORA_TARGETS) if t in manager.active_targets)
    return manager.row_slots, mask


def stack_hidden(
    model,
    stack: LayerStack,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    prompt_runs: torch.Tensor | None = None,
    lora_rows: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The model's final hidden states [tokens, hidden] (normed), as model.forward returns them
    (prompt_runs: see StackBatch; lora_rows: stack_lora_rows' adapter slots and targets)."""
    batch = StackBatch(
        positions,
        meta.slot_mapping,
        meta.decode_block_tables,
        meta.decode_context_lens,
        meta.prefill_block_tables,
        meta.prefill_query_start_loc,
        meta.prefill_context_lens,
        prompt_runs,
        *(lora_rows or (None,)),
    )
    hidden, residual = stack.run(model.embed_tokens(input_ids), batch, torch.get_num_threads())
    hidden, _ = model.ops.rms_norm(hidden, model.norm, model.config.rms_norm_eps, residual)
    return hidden
