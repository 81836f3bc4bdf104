"""The one-call native decoder layers (kernels/decode_layers.py) against the composition of the
kernels' PyTorch references, and its input checks."""

from __future__ import annotations

import pytest
import torch

from kernels import small_m_linear
from kernels.decode_layers import DecodeGeometry, DecodeLayers, DecodeLayerWeights, decode_layers_reference, entry_points
from kernels.rotary import build_rope_cache

if entry_points() is None:
    pytest.skip("the native CPU kernels do not build here", allow_module_level=True)

BLOCK_SIZE, NUM_BLOCKS = 4, 12


def geometry(softcap=None) -> DecodeGeometry:
    return DecodeGeometry(hidden_size=64, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-5,
                          scale=16 ** -0.5, softcap=softcap)


def random_layers(g: DecodeGeometry, windows, gen) -> list[DecodeLayerWeights]:
    def packed(n, k):
        return small_m_linear.pack_weight(torch.randn(n, k, generator=gen) * k ** -0.5)

    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    cache = (NUM_BLOCKS, BLOCK_SIZE, g.num_kv_heads, g.head_dim)
    return [DecodeLayerWeights(
        input_norm=1 + 0.1 * torch.randn(g.hidden_size, generator=gen), qkv=packed(q + 2 * kv, g.hidden_size),
        o=packed(g.hidden_size, q), post_norm=1 + 0.1 * torch.randn(g.hidden_size, generator=gen),
        gate_up=packed(2 * g.intermediate_size, g.hidden_size), down=packed(g.hidden_size, g.intermediate_size),
        k_cache=torch.randn(cache, generator=gen), v_cache=torch.randn(cache, generator=gen), window=w)
        for w in windows]


def batch(context_lens: list[int], gen):
    """Block tables (pages scattered over the cache), positions and slots of one decode step."""
    pages = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max((-(-n // BLOCK_SIZE) for n in context_lens), default=1)
    tables, slots = [], []
    for n in context_lens:
        row = [pages.pop() for _ in range(-(-n // BLOCK_SIZE))]
        slots.append(row[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
        tables.append(row + [0] * (width - len(row)))
    return (torch.tensor([n - 1 for n in context_lens], dtype=torch.int64), torch.tensor(slots, dtype=torch.int64),
            torch.tensor(tables, dtype=torch.int32).reshape(len(context_lens), width),
            torch.tensor(context_lens, dtype=torch.int32))


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_references_layer_by_layer(softcap, threads):
    gen = torch.Generator().manual_seed(7)
    g = geometry(softcap)
    layers = random_layers(g, [None, 5, None], gen)  # a sliding-window layer between two full ones
    copies = [DecodeLayerWeights(**{**w.__dict__, "k_cache": w.k_cache.clone(), "v_cache": w.v_cache.clone()})
              for w in layers]
    rope = build_rope_cache(g.head_dim, 64, 10000.0, None)
    hidden = torch.randn(3, g.hidden_size, generator=gen)
    step = batch([1, 7, 13], gen)

    out, residual = DecodeLayers(g, layers, rope).run(hidden, *step, num_threads=threads)
    want_out, want_residual = decode_layers_reference(g, copies, rope, hidden, *step)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(residual, want_residual, atol=1e-4, rtol=1e-4)
    for got, want in zip(layers, copies):  # each row's new K and V landed in its slot, nowhere else
        torch.testing.assert_close(got.k_cache, want.k_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.v_cache, want.v_cache, atol=1e-5, rtol=1e-5)


def test_an_empty_batch_and_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    g = geometry()
    layers = random_layers(g, [None, None], gen)
    rope = build_rope_cache(g.head_dim, 16, 10000.0, None)
    decode = DecodeLayers(g, layers, rope)
    out, residual = decode.run(torch.zeros(0, 64), *batch([], gen), num_threads=1)
    assert out.shape == residual.shape == (0, 64)

    positions, slots, tables, lens = batch([20, 3], gen)  # position 19 is past the 16-position rope cache
    with pytest.raises(ValueError, match="layer 0's rotary embedding kernel refused"):
        decode.run(torch.randn(2, 64), positions, slots, tables, lens, num_threads=1)
    with pytest.raises(ValueError, match="positions must be contiguous"):
        decode.run(torch.randn(2, 64), positions[:1], slots, tables, lens, num_threads=1)
    with pytest.raises(ValueError, match="block_tables dtype"):
        decode.run(torch.randn(2, 64), positions, slots, tables.long(), lens, num_threads=1)
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        decode.run(torch.randn(2, 32), positions, slots, tables, lens, num_threads=1)

    wrong = [DecodeLayerWeights(**{**layers[0].__dict__, "o": layers[0].qkv})]
    with pytest.raises(ValueError, match="layer 0 o must be a contiguous packed"):
        DecodeLayers(g, wrong, rope)
    half = [DecodeLayerWeights(**{**layers[0].__dict__, "k_cache": layers[0].k_cache.bfloat16()})]
    with pytest.raises(ValueError, match="layer 0 k_cache dtype"):
        DecodeLayers(g, half, rope)
