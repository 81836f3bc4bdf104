"""What the native layer stack (kernels/layer_stack.py) takes: one step's batch (`StackBatch`, with
its own checks), the model's shapes (`LayerGeometry`), one layer's weights and caches
(`LayerWeights`), and LoRA adapters' device slots (`StackLoRA`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._checks import check_tensor, require
from kernels.layer_stack_abi import LORA_TARGETS, TILED

__all__ = ["LayerGeometry", "LayerWeights", "StackBatch", "StackLoRA"]


@dataclass(frozen=True)
class StackBatch:
    """One step's batch of T tokens: one token of each decode row first, then the prefill chunks
    (workers/models/llama.py's AttentionMetadata, with the tokens' positions). positions,
    slot_mapping: int64 [T]; decode_block_tables: int32 [num_decode, W]; decode_context_lens: int32
    [num_decode] (each row's context, its new token included); prefill_block_tables: int32
    [num_prefill, W']; prefill_query_start: int32 [num_prefill + 1] (the chunks' bounds, from 0 at
    the first prefill token); prefill_context_lens: int32 [num_prefill] (each sequence's tokens, its
    chunk included); prompt_runs: int64 [R, 2], the [start, end) row ranges (rising, apart) of tokens
    in their sequence's prompt, which a stack with AMX tiles projects with kernels.amx_linear."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_start: torch.Tensor
    prefill_context_lens: torch.Tensor
    prompt_runs: torch.Tensor | None = None
    # LoRA: each token's adapter slot, int64 [T] (-1: the base model; None: no adapter in the step),
    # and the targets any of the step's slots adapts (bit t for LORA_TARGETS[t]; all by default).
    lora_rows: torch.Tensor | None = None
    lora_targets: int = (1 << len(LORA_TARGETS)) - 1

    def check(self) -> tuple[int, int]:
        """(num_decode, num_prefill), or ValueError naming what is wrong."""
        for name, dtype, ndim in (
            ("positions", torch.int64, 1),
            ("slot_mapping", torch.int64, 1),
            ("decode_block_tables", torch.int32, 2),
            ("decode_context_lens", torch.int32, 1),
            ("prefill_block_tables", torch.int32, 2),
            ("prefill_query_start", torch.int32, 1),
            ("prefill_context_lens", torch.int32, 1),
        ):
            value = getattr(self, name)
            check_tensor(value, name, ndim, (dtype,))
            require(value.is_contiguous() and value.device.type == "cpu", f"{name} must be a contiguous CPU tensor")
        t, nd, npf = self.positions.shape[0], self.decode_block_tables.shape[0], self.prefill_block_tables.shape[0]
        require(self.slot_mapping.shape[0] == t, f"slot_mapping has {self.slot_mapping.shape[0]} tokens, positions {t}")
        require(self.decode_context_lens.shape[0] == nd, f"decode_context_lens must have {nd} rows")
        require(
            self.prefill_context_lens.shape[0] == npf and self.prefill_query_start.shape[0] == npf + 1,
            f"prefill_context_lens must have {npf} rows and prefill_query_start {npf + 1}",
        )
        chunks = self.prefill_query_start.tolist()
        require(
            chunks[0] == 0 and all(a < b for a, b in zip(chunks, chunks[1:])) and nd + chunks[-1] == t,
            f"prefill_query_start {chunks} must rise from 0 to the {t - nd} prefill tokens",
        )
        if self.lora_rows is not None:
            check_tensor(self.lora_rows, "lora_rows", 1, (torch.int64,))
            require(
                self.lora_rows.shape[0] == t and self.lora_rows.is_contiguous(),
                f"lora_rows must be a contiguous int64 [{t}], got {tuple(self.lora_rows.shape)}",
            )
        if self.prompt_runs is not None:
            check_tensor(self.prompt_runs, "prompt_runs", 2, (torch.int64,))
            require(
                self.prompt_runs.is_contiguous() and self.prompt_runs.shape[1] == 2,
                f"prompt_runs must be a contiguous [runs, 2], got {tuple(self.prompt_runs.shape)}",
            )
            bounds = self.prompt_runs.flatten().tolist()
            require(
                all(a < b for a, b in zip(bounds[::2], bounds[1::2]))
                and all(a <= b for a, b in zip(bounds, bounds[1:]))
                and (not bounds or (bounds[0] >= 0 and bounds[-1] <= t)),
                f"prompt_runs {bounds} must be non-empty [start, end) ranges rising within the {t} tokens",
            )
        return nd, npf


@dataclass(frozen=True)
class LayerGeometry:
    """The model's shapes and constants, as the layer-by-layer pass uses them."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention's score scale
    softcap: float | None = None  # attention logit soft-cap (Gemma 2), None: none


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: its norms' weights, its projections packed by kernels.small_m_linear
    ([N / 16, K, 16] float32), its KV cache pages ([num_blocks, block_size, num_kv_heads,
    head_dim] float32 each) and its sliding window (None: full attention). The *_tiles are the
    projections split by kernels.amx_linear.pack_weight, all four or none: with them the prompt rows
    of a step (StackBatch.prompt_runs) are projected as bf16x3 on AMX."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    window: int | None = None
    qkv_tiles: torch.Tensor | None = None
    o_tiles: torch.Tensor | None = None
    gate_up_tiles: torch.Tensor | None = None
    down_tiles: torch.Tensor | None = None

    def tiles(self) -> list[torch.Tensor | None]:
        return [getattr(self, f"{name}_tiles") for name in TILED]


@dataclass(frozen=True)
class StackLoRA:
    """LoRA adapters' device slots for a stack: per layer, per target of LORA_TARGETS, A [slots,
    rank, in] and B [slots, out, rank] float32 (a smaller rank zero-padded), and each slot's
    scaling [slots] float32. The stack holds their addresses: they are written in place."""

    a: list[dict[str, torch.Tensor]]
    b: list[dict[str, torch.Tensor]]
    scaling: torch.Tensor
