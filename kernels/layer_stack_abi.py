"""The C side of the native layer stack (kernels/csrc/layer_stack.cpp), as ctypes sees it: the
structs its entry point takes (the kernels it calls, each layer's weights and caches, the model's
shapes, one step's batch), field for field in the C struct order, and where the entry points are.
kernels.layer_stack fills them and checks every value first."""

from __future__ import annotations

import ctypes

from kernels import amx_linear, cpu_native

__all__ = [
    "F32",
    "FP",
    "I32",
    "I64",
    "KERNELS",
    "LORA_TARGETS",
    "TILED",
    "KernelTable",
    "LayerArgs",
    "ShapeArgs",
    "StepArgs",
    "entry_points",
    "native_layer_stack",
]

FP = ctypes.c_void_p
I64, I32, F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float

# The kernels the layers call: (field, library, symbol), in StackKernels' field order.
KERNELS = (
    ("rms_norm", "rms_norm", "baton_rms_norm"),
    ("linear", "small_m_linear", "baton_small_m_linear"),
    ("rotary", "rotary", "baton_rotary"),
    ("store_kv", "kv_store", "baton_store_kv"),
    ("decode_attention", "paged_decode_attention", "baton_paged_decode_attention"),
    ("prefill_attention", "paged_prefill_attention", "baton_paged_prefill_attention"),
    ("silu_and_mul", "silu_mul", "baton_silu_and_mul"),
)


TILED = ("qkv", "o", "gate_up", "down")
# LoRA's targets in the C enum LoraTarget's order (common/lora.py LORA_TARGETS).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class KernelTable(ctypes.Structure):
    """The entry points of the kernels the layers call (KERNELS, then AMX's linear and the batched
    LoRA kernel, each or null)."""

    _fields_ = [(field, FP) for field, _, _ in KERNELS] + [("amx_linear", FP), ("lora_add", FP)]


class LayerArgs(ctypes.Structure):
    """One layer's weights (packed, and their AMX tiles or null), its KV caches and its window."""

    _fields_ = (
        [(name, FP) for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache")]
        + [("window", I64)]
        + [(f"{name}_tiles", FP) for name in TILED]
        + [("lora_a", FP * len(LORA_TARGETS)), ("lora_b", FP * len(LORA_TARGETS))]
    )


class ShapeArgs(ctypes.Structure):
    """The model's shapes and constants, the same for every layer."""

    _fields_ = [
        ("hidden", I64),
        ("intermediate", I64),
        ("num_heads", I32),
        ("num_kv_heads", I32),
        ("head_dim", I32),
        ("block_size", I32),
        ("num_blocks", I64),
        ("cos_sin", FP),
        ("max_position", I64),
        ("eps", F32),
        ("scale", F32),
        ("softcap", F32),
        ("lora_rank", I64),
        ("lora_slots", I64),
    ]


class StepArgs(ctypes.Structure):
    """One step's batch (decode rows, then prefill chunks) and its work buffers."""

    _fields_ = [
        ("T", I64),
        ("positions", FP),
        ("slots", FP),
        ("num_decode", I64),
        ("decode_block_tables", FP),
        ("decode_width", I64),
        ("decode_context_lens", FP),
        ("num_prefill", I64),
        ("prefill_block_tables", FP),
        ("prefill_width", I64),
        ("prefill_query_start", FP),
        ("prefill_context_lens", FP),
        *[(name, FP) for name in ("hidden", "residual", "normed", "qkv", "attn", "gate_up", "act")],
        ("prompt_runs", FP),
        ("num_prompt_runs", I64),
        ("lora_rows", FP),
        ("lora_scaling", FP),
        ("lora_targets", I64),
    ]


def entry_points() -> KernelTable | None:
    """The kernels' entry points, or None when a library (this one's included) does not build."""
    addresses = [cpu_native.address(library, symbol) for _, library, symbol in KERNELS]
    if None in addresses or native_layer_stack() is None:
        return None
    amx = cpu_native.address("amx_linear", "baton_amx_linear") if amx_linear.ready() else None
    return KernelTable(*addresses, amx, cpu_native.address("lora", "baton_lora_add"))


def native_layer_stack():
    return cpu_native.function("layer_stack", "baton_layer_stack", (FP, FP, I32, FP, FP, I32))
