"""A float32 step's decoder layers in one native call (kernels/csrc/layer_stack.cpp).

A step of a small model on one CPU core spends its time in a dozen kernels per layer, and, between
them, in Python: the module calls, each kernel's argument checks and its ctypes call, some 400
trips a step. On the default model that was about a sixth of a float32 decode step of 16 sequences
on one thread (bench/decode_profile.py), whatever the batch. `LayerStack` checks the weights, the KV
cache and the geometry once, when it is built, and each step's batch once per step; the C++ side
then calls the same native kernels (rms_norm, small_m_linear, rotary, kv_store, the decode and
prefill attentions, silu_mul), in the same order and with the same arguments as the model's
layer-by-layer forward pass, through their entry points in their own libraries. Its output is
therefore that pass's, bit for bit (tests/engine/test_cpu_layer_stack.py). It is the CPU's
counterpart of a CUDA graph (workers/engine/cuda_graphs.py): the layers' kernels without the host's work
between them. A step may mix decode rows and prefill chunks (`StackBatch`), as the engine's steps
do: a long prompt's chunk gains little, a speculative verification or a short prompt beside the
decode rows gains what a decode step does.

What it covers: float32 weights packed for small_m_linear (no biases), a float32 KV cache, no
per-head q/k norm, no tensor parallelism; workers/engine/cpu_layer_stack.py decides, per model, and leaves
every other case on the layer-by-layer pass. With LoRA adapters (`attach_lora`: the stacked
matrices of workers/lora/manager.py), a step whose rows run under adapters (StackBatch.lora_rows)
adds each projection's update right after it with the batched LoRA kernel (kernels/lora.py), as
the layer-by-layer pass's LoRA projections do.

The reference, `layer_stack_reference`, composes the kernels' PyTorch references.
"""

from __future__ import annotations

import ctypes

import torch
from torch.nn import functional as F

from common.lora import lora_target_shapes
from kernels import amx_linear
from kernels._checks import check_tensor, require
from kernels.decode_attention import paged_decode_attention_reference
from kernels.kv_store import store_kv_reference
from kernels.layer_stack_abi import (
    LORA_TARGETS,
    TILED,
    LayerArgs,
    ShapeArgs,
    StepArgs,
    entry_points,
    native_layer_stack,
)
from kernels.layer_stack_inputs import LayerGeometry, LayerWeights, StackBatch, StackLoRA
from kernels.lora import lora_add_reference
from kernels.prefill_attention import native_shape, paged_prefill_attention_reference
from kernels.rms_norm import rms_norm_reference
from kernels.rotary import rotary_embedding_reference
from kernels.silu_mul import silu_and_mul_reference
from kernels.small_m_linear import unpack_weight

_STAGES = (
    "input norm",
    "qkv projection",
    "rotary embedding",
    "KV store",
    "decode attention",
    "prefill attention",
    "o projection",
    "post-attention norm",
    "gate/up projection",
    "SiLU-and-mul",
    "down projection",
    "q/k/v LoRA",
    "o LoRA",
    "gate/up LoRA",
    "down LoRA",
)


def _packed(t: torch.Tensor, name: str, n: int, k: int) -> None:
    check_tensor(t, name, 3, (torch.float32,))
    require(
        tuple(t.shape) == (n // 16, k, 16) and t.is_contiguous(),
        f"{name} must be a contiguous packed [{n // 16}, {k}, 16] float32 weight, got {tuple(t.shape)}",
    )


class LayerStack:
    """The decoder layers of a float32 model, ready to run a step's batch in one call."""

    def __init__(self, geometry: LayerGeometry, layers: list[LayerWeights], cos_sin_cache: torch.Tensor) -> None:
        kernels = entry_points()
        if kernels is None:
            raise ValueError("the native kernels are not built on this machine")
        require(len(layers) > 0, "a model has at least one decoder layer")
        g = geometry
        require(g.num_heads % g.num_kv_heads == 0, f"{g.num_heads} query heads do not group over {g.num_kv_heads}")
        require(g.hidden_size <= 8192, f"hidden size {g.hidden_size} is past the native RMSNorm's 8192")
        q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        check_tensor(cos_sin_cache, "cos_sin_cache", 2, (torch.float32,))
        require(
            cos_sin_cache.shape[1] == g.head_dim and cos_sin_cache.is_contiguous(),
            f"cos_sin_cache must be contiguous [positions, {g.head_dim}], got {tuple(cos_sin_cache.shape)}",
        )
        cache_shape = tuple(layers[0].k_cache.shape)
        require(
            len(cache_shape) == 4 and cache_shape[2:] == (g.num_kv_heads, g.head_dim),
            f"KV cache pages must be [blocks, block_size, {g.num_kv_heads}, {g.head_dim}], got {cache_shape}",
        )
        for i, w in enumerate(layers):
            for name, t in (("input_norm", w.input_norm), ("post_norm", w.post_norm)):
                check_tensor(t, f"layer {i} {name}", 1, (torch.float32,))
                require(
                    t.shape[0] == g.hidden_size and t.is_contiguous(), f"layer {i} {name} must be [{g.hidden_size}]"
                )
            _packed(w.qkv, f"layer {i} qkv", q + 2 * kv, g.hidden_size)
            _packed(w.o, f"layer {i} o", g.hidden_size, q)
            _packed(w.gate_up, f"layer {i} gate_up", 2 * g.intermediate_size, g.hidden_size)
            _packed(w.down, f"layer {i} down", g.hidden_size, g.intermediate_size)
            for name, c in (("k_cache", w.k_cache), ("v_cache", w.v_cache)):
                check_tensor(c, f"layer {i} {name}", 4, (torch.float32,))
                require(
                    tuple(c.shape) == cache_shape and c.is_contiguous(),
                    f"layer {i} {name} must be contiguous {cache_shape}, got {tuple(c.shape)}",
                )
            require(w.window is None or w.window >= 1, f"layer {i} window must be >= 1, got {w.window}")
            _check_tiles(w, i)
        self.lora: StackLoRA | None = None
        self.geometry, self.block_size = g, cache_shape[1]
        require(self.block_size & (self.block_size - 1) == 0, f"block size {self.block_size} is not a power of two")
        # The native prefill attention is compiled for a few block sizes and head dims only; with
        # others the model's pass runs the steps that prefill (on the PyTorch reference).
        self.takes_prefill = native_shape(self.block_size, g.head_dim)
        self._kernels = kernels
        self._weights = layers  # the structs below point into these tensors
        self._cos_sin = cos_sin_cache
        self._layers = (LayerArgs * len(layers))(
            *[
                LayerArgs(
                    w.input_norm.data_ptr(),
                    w.qkv.data_ptr(),
                    w.o.data_ptr(),
                    w.post_norm.data_ptr(),
                    w.gate_up.data_ptr(),
                    w.down.data_ptr(),
                    w.k_cache.data_ptr(),
                    w.v_cache.data_ptr(),
                    w.window or 0,
                    *(None if t is None else t.data_ptr() for t in w.tiles()),
                )
                for w in layers
            ]
        )
        # Prompt rows go to amx_linear only where every layer has its tiles and the kernel runs here.
        self.tiled = kernels.amx_linear is not None and all(t is not None for w in layers for t in w.tiles())
        self._shapes = ShapeArgs(
            g.hidden_size,
            g.intermediate_size,
            g.num_heads,
            g.num_kv_heads,
            g.head_dim,
            self.block_size,
            cache_shape[0],
            cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0],
            g.eps,
            g.scale,
            g.softcap or 0.0,
        )

    @property
    def takes_lora(self) -> bool:
        """Whether steps with adapter rows run here (LoRA attached, its kernel built)."""
        return self.lora is not None and bool(self._kernels.lora_add)

    def attach_lora(self, lora: StackLoRA) -> None:
        """Run adapter rows too: the update of each target after its projection (kernels/lora.py)."""
        g = self.geometry
        q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        shapes = lora_target_shapes(g.hidden_size, q, kv, g.intermediate_size)
        require(
            len(lora.a) == len(lora.b) == len(self._weights), f"LoRA stacks for {len(self._weights)} layers expected"
        )
        check_tensor(lora.scaling, "lora scaling", 1, (torch.float32,))
        slots = lora.scaling.shape[0]
        rank = lora.a[0][LORA_TARGETS[0]].shape[1]
        for layer, (a_stacks, b_stacks) in enumerate(zip(lora.a, lora.b)):
            for target in LORA_TARGETS:
                width, out = shapes[target]
                a, b = a_stacks[target], b_stacks[target]
                check_tensor(a, f"layer {layer} {target} A", 3, (torch.float32,))
                check_tensor(b, f"layer {layer} {target} B", 3, (torch.float32,))
                require(
                    tuple(a.shape) == (slots, rank, width) and tuple(b.shape) == (slots, out, rank),
                    f"layer {layer} {target}: A {tuple(a.shape)} and B {tuple(b.shape)} must be "
                    f"[{slots}, {rank}, {width}] and [{slots}, {out}, {rank}]",
                )
                require(a.is_contiguous() and b.is_contiguous(), f"layer {layer} {target}: A and B must be contiguous")
            args = self._layers[layer]
            for t, target in enumerate(LORA_TARGETS):
                args.lora_a[t] = a_stacks[target].data_ptr()
                args.lora_b[t] = b_stacks[target].data_ptr()
        self._shapes.lora_rank, self._shapes.lora_slots = rank, slots
        self.lora = lora  # the structs point into these tensors

    def run(self, hidden: torch.Tensor, batch: StackBatch, num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers over the batch's T tokens: (the last layer's output, the residual stream),
        each [T, hidden], as the model's layer loop returns them. hidden: the tokens' embeddings
        [T, hidden] float32."""
        g = self.geometry
        check_tensor(hidden, "hidden", 2, (torch.float32,))
        T = hidden.shape[0]
        require(
            hidden.shape[1] == g.hidden_size and hidden.is_contiguous(),
            f"hidden must be contiguous [T, {g.hidden_size}], got {tuple(hidden.shape)}",
        )
        nd, npf = batch.check()
        require(batch.positions.shape[0] == T, f"the batch has {batch.positions.shape[0]} tokens, hidden {T}")
        require(
            npf == 0 or self.takes_prefill,
            f"no native prefill attention for block size {self.block_size} and "
            f"head dim {g.head_dim}: this stack runs decode-only steps",
        )
        require(
            nd == 0 or int(batch.decode_context_lens.max()) <= batch.decode_block_tables.shape[1] * self.block_size,
            "a decode row's context is longer than its block table holds",
        )
        require(num_threads >= 1, f"num_threads must be >= 1, got {num_threads}")
        lora_rows = batch.lora_rows
        if lora_rows is not None:
            require(self.takes_lora, "a step with LoRA adapter rows on a stack without LoRA (attach_lora)")
            assert self.lora is not None
            require(
                not lora_rows.numel() or int(lora_rows.max()) < self.lora.scaling.shape[0],
                f"a LoRA slot id past the stack's {self.lora.scaling.shape[0]} slots",
            )
        hidden = hidden.clone()  # the layers write their output over their input
        q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        buffers = {
            name: torch.empty(T, width)
            for name, width in (
                ("residual", g.hidden_size),
                ("normed", g.hidden_size),
                ("qkv", q + 2 * kv),
                ("attn", q),
                ("gate_up", 2 * g.intermediate_size),
                ("act", g.intermediate_size),
            )
        }
        b = batch
        runs = b.prompt_runs if b.prompt_runs is not None and self.tiled else None
        step = StepArgs(
            T,
            b.positions.data_ptr(),
            b.slot_mapping.data_ptr(),
            nd,
            b.decode_block_tables.data_ptr(),
            b.decode_block_tables.shape[1],
            b.decode_context_lens.data_ptr(),
            npf,
            b.prefill_block_tables.data_ptr(),
            b.prefill_block_tables.shape[1],
            b.prefill_query_start.data_ptr(),
            b.prefill_context_lens.data_ptr(),
            hidden.data_ptr(),
            *(buf.data_ptr() for buf in buffers.values()),
            None if runs is None else runs.data_ptr(),
            0 if runs is None else runs.shape[0],
            None if lora_rows is None else lora_rows.data_ptr(),
            None if lora_rows is None or self.lora is None else self.lora.scaling.data_ptr(),
            batch.lora_targets,
        )
        if T:
            err = native_layer_stack()(
                ctypes.byref(self._kernels),
                self._layers,
                len(self._weights),
                ctypes.byref(self._shapes),
                ctypes.byref(step),
                num_threads,
            )
            if err:
                layer, stage, status = err // 1000 - 1, err % 1000 // 10, err % 10
                why = (
                    "a LoRA slot past the stacks, or a target without its matrices"
                    if stage > len(_STAGES) - 4
                    else "positions past the rope cache, slots past the KV cache, "
                    "a context shorter than its chunk, or a context length below 1"
                )
                raise ValueError(
                    f"native layer stack: layer {layer}'s {_STAGES[stage - 1]} kernel refused the batch "
                    f"(status {status}: {why})"
                )
        return hidden, buffers["residual"]


def _check_tiles(w: LayerWeights, layer: int) -> None:
    """The tiles of a layer whose packed projections are already checked: all or none, each of its
    projection's shape."""
    tiles = w.tiles()
    present = [t for t in tiles if t is not None]
    if not present:
        return
    require(len(present) == len(tiles), f"layer {layer} has tiles for some projections only")
    for name, t in zip(TILED, present):
        blocks, k, _ = getattr(w, name).shape
        shape = (blocks, -(-k // amx_linear.TILE_K), 2, 16, 32)
        check_tensor(t, f"layer {layer} {name}_tiles", 5, (torch.int16,))
        require(
            tuple(t.shape) == shape and t.is_contiguous(),
            f"layer {layer} {name}_tiles must be contiguous {shape} (kernels.amx_linear.pack_weight), "
            f"got {tuple(t.shape)}",
        )


def layer_stack_reference(
    geometry: LayerGeometry,
    layers: list[LayerWeights],
    cos_sin_cache: torch.Tensor,
    hidden: torch.Tensor,
    batch: StackBatch,
    lora: StackLoRA | None = None,
):
    """The same layers from the kernels' PyTorch references (KV written into the caches too); the
    prompt runs of layers with tiles through the bf16x3 reference; with `lora` and the batch's
    lora_rows, each projection's LoRA update from kernels.lora's reference."""
    g, b = geometry, batch

    def adapted(layer: int, targets: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if lora is None or b.lora_rows is None:
            return y
        parts, start = [], 0
        for target in targets:
            a_stack, b_stack = lora.a[layer][target], lora.b[layer][target]
            width = b_stack.shape[1]
            parts.append(
                lora_add_reference(y[:, start : start + width], x, a_stack, b_stack, b.lora_rows, lora.scaling)
            )
            start += width
        return torch.cat(parts, dim=1)

    runs = [] if b.prompt_runs is None else b.prompt_runs.tolist()

    def linear(x: torch.Tensor, packed: torch.Tensor, tiles: torch.Tensor | None) -> torch.Tensor:
        weight = unpack_weight(packed)
        y = F.linear(x, weight)
        for start, end in runs if tiles is not None else []:
            y[start:end] = amx_linear.bf16x3_linear_reference(x[start:end], weight)
        return y

    nd = b.decode_block_tables.shape[0]
    q_size, kv_size = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    residual = None
    for i, w in enumerate(layers):
        if residual is None:
            residual, x = hidden, rms_norm_reference(hidden, w.input_norm, g.eps)
        else:
            x, residual = rms_norm_reference(hidden, w.input_norm, g.eps, residual)
        qkv = adapted(i, ("q_proj", "k_proj", "v_proj"), x, linear(x, w.qkv, w.qkv_tiles))
        T = qkv.shape[0]
        qh = qkv[:, :q_size].view(T, g.num_heads, g.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(T, g.num_kv_heads, g.head_dim)
        v = qkv[:, q_size + kv_size :].view(T, g.num_kv_heads, g.head_dim)
        rotary_embedding_reference(b.positions, qh, k, cos_sin_cache)
        store_kv_reference(k, v, w.k_cache, w.v_cache, b.slot_mapping)
        attn = torch.empty_like(qh)
        if nd:
            attn[:nd] = paged_decode_attention_reference(
                qh[:nd],
                w.k_cache,
                w.v_cache,
                b.decode_block_tables,
                b.decode_context_lens,
                g.scale,
                window=w.window,
                softcap=g.softcap,
            )
        if nd < T:
            attn[nd:] = paged_prefill_attention_reference(
                qh[nd:],
                w.k_cache,
                w.v_cache,
                b.prefill_block_tables,
                b.prefill_query_start,
                b.prefill_context_lens,
                g.scale,
                window=w.window,
                softcap=g.softcap,
            )
        attn = attn.reshape(T, q_size)
        o = adapted(i, ("o_proj",), attn, linear(attn, w.o, w.o_tiles))
        x, residual = rms_norm_reference(o, w.post_norm, g.eps, residual)
        act = silu_and_mul_reference(adapted(i, ("gate_proj", "up_proj"), x, linear(x, w.gate_up, w.gate_up_tiles)))
        hidden = adapted(i, ("down_proj",), act, linear(act, w.down, w.down_tiles))
    return hidden, residual
