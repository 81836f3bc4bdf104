"""The one-call native decoder layers (kernels/layer_stack.py) against the composition of the
kernels' PyTorch references, on decode rows, prefill chunks and both in one step, and its input checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.lora import lora_target_shapes
from kernels import amx_linear, small_m_linear
from kernels.layer_stack import (
    LayerGeometry,
    LayerStack,
    LayerWeights,
    StackBatch,
    StackLoRA,
    entry_points,
    layer_stack_reference,
)
from kernels.rotary import build_rope_cache

if entry_points() is None:
    pytest.skip("the native CPU kernels do not build here", allow_module_level=True)

# The native prefill attention is compiled for blocks of 16 and head dims of 64 and 128.
BLOCK_SIZE, NUM_BLOCKS = 16, 24


def geometry(softcap=None, head_dim=64) -> LayerGeometry:
    heads = 128 // head_dim
    return LayerGeometry(
        hidden_size=64,
        intermediate_size=48,
        num_heads=heads,
        num_kv_heads=heads // 2,
        head_dim=head_dim,
        eps=1e-5,
        scale=head_dim**-0.5,
        softcap=softcap,
    )


def random_layers(g: LayerGeometry, windows, gen) -> list[LayerWeights]:
    def packed(n, k):
        return small_m_linear.pack_weight(torch.randn(n, k, generator=gen) * k**-0.5)

    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    cache = (NUM_BLOCKS, BLOCK_SIZE, g.num_kv_heads, g.head_dim)
    return [
        LayerWeights(
            input_norm=1 + 0.1 * torch.randn(g.hidden_size, generator=gen),
            qkv=packed(q + 2 * kv, g.hidden_size),
            o=packed(g.hidden_size, q),
            post_norm=1 + 0.1 * torch.randn(g.hidden_size, generator=gen),
            gate_up=packed(2 * g.intermediate_size, g.hidden_size),
            down=packed(g.hidden_size, g.intermediate_size),
            k_cache=torch.randn(cache, generator=gen),
            v_cache=torch.randn(cache, generator=gen),
            window=w,
        )
        for w in windows
    ]


def batch(context_lens: list[int], gen, chunks: list[tuple[int, int]] = ()) -> StackBatch:
    """A step over scattered pages: one token of each decode row (its context length), then a
    chunk of each prefill sequence ((tokens before it, its length))."""
    pages = torch.randperm(NUM_BLOCKS, generator=gen).tolist()

    def table(lens: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Each sequence's pages, and the padded int32 block table."""
        tables = [[pages.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lens]
        width = max((len(t) for t in tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return tables, torch.tensor(padded, dtype=torch.int32).reshape(len(lens), width)

    decode_pages, decode_tables = table(context_lens)
    prefill_pages, prefill_tables = table([before + n for before, n in chunks])
    # (pages, positions) of each sequence's new tokens, decode rows first.
    spans = [(t, [n - 1]) for t, n in zip(decode_pages, context_lens)]
    spans += [(t, list(range(before, before + n))) for t, (before, n) in zip(prefill_pages, chunks)]
    positions = [p for _, ps in spans for p in ps]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, ps in spans for p in ps]
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    return StackBatch(
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        decode_tables,
        torch.tensor(context_lens, dtype=torch.int32),
        prefill_tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([before + n for before, n in chunks], dtype=torch.int32),
    )


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,head_dim", [("decode", 16), ("decode", 64), ("prefill", 64), ("both", 64)])
def test_matches_the_references_layer_by_layer(softcap, threads, rows, head_dim):
    gen = torch.Generator().manual_seed(7)
    g = geometry(softcap, head_dim)
    layers = random_layers(g, [None, 21, None], gen)  # a sliding-window layer between two full ones
    copies = [
        LayerWeights(**{**w.__dict__, "k_cache": w.k_cache.clone(), "v_cache": w.v_cache.clone()}) for w in layers
    ]
    rope = build_rope_cache(g.head_dim, 64, 10000.0, None)
    decode = [1, 17, 40] if rows != "prefill" else []
    chunks = [(0, 19), (35, 8)] if rows != "decode" else []  # a whole prompt, and a chunk after 35 cached tokens
    step = batch(decode, gen, chunks)
    hidden = torch.randn(step.positions.shape[0], g.hidden_size, generator=gen)

    out, residual = LayerStack(g, layers, rope).run(hidden, step, num_threads=threads)
    want_out, want_residual = layer_stack_reference(g, copies, rope, hidden, step)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(residual, want_residual, atol=1e-4, rtol=1e-4)
    for got, want in zip(layers, copies):  # each token's K and V landed in its slot, nowhere else
        torch.testing.assert_close(got.k_cache, want.k_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v_cache, want.v_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not amx_linear.ready(), reason="no AMX-BF16 here")
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_runs_take_the_bf16x3_projections_and_other_rows_float32(threads):
    gen = torch.Generator().manual_seed(5)
    g = geometry(None, 64)
    layers = [
        replace(
            w, **{f"{name}_tiles": amx_linear.pack_weight(getattr(w, name)) for name in ("qkv", "o", "gate_up", "down")}
        )
        for w in random_layers(g, [None, 21], gen)
    ]
    rope = build_rope_cache(g.head_dim, 64, 10000.0, None)
    # Decode rows 0-2, then a whole 19-token prompt (rows 3-21) and a 9-token chunk of which the
    # first 5 tokens close a prompt (rows 22-26) and the last 4 are recomputed outputs.
    step = replace(batch([1, 17, 40], gen, [(0, 19), (35, 9)]), prompt_runs=torch.tensor([[3, 27]], dtype=torch.int64))
    hidden = torch.randn(step.positions.shape[0], g.hidden_size, generator=gen)
    copies = [
        LayerWeights(**{**w.__dict__, "k_cache": w.k_cache.clone(), "v_cache": w.v_cache.clone()}) for w in layers
    ]
    stack = LayerStack(g, layers, rope)
    assert stack.tiled
    out, residual = stack.run(hidden, step, num_threads=threads)
    want_out, want_residual = layer_stack_reference(g, copies, rope, hidden, step)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(residual, want_residual, atol=1e-4, rtol=1e-4)
    # The decode rows (their own pages, no prompt row's KV) are the float32 pass's bits; the prompt
    # rows differ from it (they did run on the tiles). The reference above checked rows 27-30 too.
    plain, _ = LayerStack(
        g, [replace(w, qkv_tiles=None, o_tiles=None, gate_up_tiles=None, down_tiles=None) for w in copies], rope
    ).run(hidden, step, num_threads=threads)
    assert torch.equal(out[:3], plain[:3]) and not torch.equal(out[3:27], plain[3:27])
    with pytest.raises(ValueError, match="prompt_runs"):
        stack.run(hidden, replace(step, prompt_runs=torch.tensor([[3, 40]], dtype=torch.int64)), num_threads=1)
    with pytest.raises(ValueError, match="tiles for some projections only"):
        LayerStack(g, [replace(layers[0], o_tiles=None)], rope)


def test_an_empty_batch_and_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    g = geometry(head_dim=16)
    layers = random_layers(g, [None, None], gen)
    rope = build_rope_cache(g.head_dim, 16, 10000.0, None)
    stack = LayerStack(g, layers, rope)
    out, residual = stack.run(torch.zeros(0, 64), batch([], gen), num_threads=1)
    assert out.shape == residual.shape == (0, 64)

    step = batch([20, 3], gen)  # position 19 is past the 16-position rope cache
    with pytest.raises(ValueError, match="layer 0's rotary embedding kernel refused"):
        stack.run(torch.randn(2, 64), step, num_threads=1)
    step = batch([4, 3], gen)
    with pytest.raises(ValueError, match="the batch has 2 tokens, hidden 3"):
        stack.run(torch.randn(3, 64), step, num_threads=1)
    with pytest.raises(ValueError, match="longer than its block table"):
        stack.run(
            torch.randn(2, 64),
            replace(step, decode_context_lens=torch.tensor([17, 3], dtype=torch.int32)),
            num_threads=1,
        )
    with pytest.raises(ValueError, match="decode_block_tables dtype"):
        stack.run(torch.randn(2, 64), replace(step, decode_block_tables=step.decode_block_tables.long()), num_threads=1)
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        stack.run(torch.randn(2, 32), step, num_threads=1)
    chunked = batch([], gen, [(0, 3)])
    with pytest.raises(ValueError, match="prefill_query_start"):
        stack.run(
            torch.randn(3, 64),
            replace(chunked, prefill_query_start=torch.tensor([0, 2], dtype=torch.int32)),
            num_threads=1,
        )
    assert not stack.takes_prefill  # head dim 16: no native prefill attention, decode-only steps
    with pytest.raises(ValueError, match="runs decode-only steps"):
        stack.run(torch.randn(3, 64), chunked, num_threads=1)

    wrong = [LayerWeights(**{**layers[0].__dict__, "o": layers[0].qkv})]
    with pytest.raises(ValueError, match="layer 0 o must be a contiguous packed"):
        LayerStack(g, wrong, rope)
    half = [LayerWeights(**{**layers[0].__dict__, "k_cache": layers[0].k_cache.bfloat16()})]
    with pytest.raises(ValueError, match="layer 0 k_cache dtype"):
        LayerStack(g, half, rope)


def random_lora(g: LayerGeometry, num_layers: int, slots: int, rank: int, gen) -> StackLoRA:
    """Random adapters in `slots` slots, each adapting some targets only (the others zeros, as the
    engine's slots hold an adapter that does not adapt them)."""
    shapes = lora_target_shapes(
        g.hidden_size, g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim, g.intermediate_size
    )
    a_layers, b_layers = [], []
    for _ in range(num_layers):
        a_stacks, b_stacks = {}, {}
        for n, (target, (width, out)) in enumerate(shapes.items()):
            a = torch.randn(slots, rank, width, generator=gen) * 0.3
            b = torch.randn(slots, out, rank, generator=gen) * 0.3
            a[n % slots] = 0.0  # slot n % slots does not adapt this target
            a_stacks[target], b_stacks[target] = a, b
        a_layers.append(a_stacks)
        b_layers.append(b_stacks)
    return StackLoRA(a_layers, b_layers, torch.rand(slots, generator=gen) + 0.5)


@pytest.mark.parametrize("rows", ["decode", "both"])
def test_lora_rows_match_the_references_and_leave_base_rows_alone(rows):
    from kernels.lora import native_built

    if not native_built():
        pytest.skip("the native LoRA kernel does not build here")
    gen = torch.Generator().manual_seed(11)
    g = geometry(None, 64)
    layers = random_layers(g, [None, None], gen)
    copies = [
        LayerWeights(**{**w.__dict__, "k_cache": w.k_cache.clone(), "v_cache": w.v_cache.clone()}) for w in layers
    ]
    rope = build_rope_cache(g.head_dim, 64, 10000.0, None)
    lora = random_lora(g, len(layers), slots=3, rank=4, gen=gen)
    step = batch([5, 17, 40, 9], gen, [(0, 19)] if rows == "both" else [])
    slots = ([2, -1, 0, 1] + [1] * 19)[: step.positions.shape[0]]
    step = replace(step, lora_rows=torch.tensor(slots, dtype=torch.int64))
    hidden = torch.randn(step.positions.shape[0], g.hidden_size, generator=gen)

    stack = LayerStack(g, layers, rope)
    stack.attach_lora(lora)
    out, residual = stack.run(hidden, step, num_threads=2)
    want_out, want_residual = layer_stack_reference(g, copies, rope, hidden, step, lora)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(residual, want_residual, atol=1e-4, rtol=1e-4)
    # Base rows (slot -1) get exactly what a stack without LoRA gives them; adapter rows do not.
    base, _ = LayerStack(g, copies, rope).run(hidden, replace(step, lora_rows=None), num_threads=2)
    assert torch.equal(out[1], base[1]) and not torch.allclose(out[0], base[0], atol=1e-3)
    with pytest.raises(ValueError, match="without LoRA"):
        LayerStack(g, copies, rope).run(hidden, step, num_threads=1)
    with pytest.raises(ValueError, match="past the stack's 3 slots"):
        stack.run(hidden, replace(step, lora_rows=torch.tensor([3] + slots[1:], dtype=torch.int64)), num_threads=1)
