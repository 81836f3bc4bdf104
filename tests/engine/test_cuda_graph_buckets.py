"""CUDA graphs for decode (workers/engine/cuda_graphs.py), checked on the CPU with a stand-in graph.

The stand-in records each capture and replay and runs the captured function eagerly, so the
buckets, the static buffers, the copy-in and the padding are the code that runs on CUDA; only
torch.cuda.CUDAGraph itself is replaced. Oracles:
- bucketing: for every batch size 1..max, the chosen bucket holds it and no smaller bucket does;
- padding: the rows past the batch carry PAD_SLOT (no KV write), a one-token context in block 0
  and token 0, and are rewritten before every replay; only the batch's rows come back;
- the real model: an engine whose decode steps replay stand-in graphs (the real decode forward,
  run on padded buffers) matches an eager engine step by step: same tokens, logits within 1e-5,
  the same KV cache; a decode step changes only its own sequences' slots, and the sampler sees
  one row per sampled sequence;
- `enforce_eager` (and the CPU) never capture.
tests/gpu/test_cuda_graph_decode.py compares a real CUDA graph replay with an eager step.
"""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.engine.helpers import save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine import model_runner
from workers.engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    PAD_SLOT,
    DecodeGraphs,
    GraphBuckets,
    decode_graphs_wanted,
    graph_batch_sizes,
)
from workers.engine.model_runner import ModelRunner
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig


class StandInGraph:
    """A graph that records capture and replay and runs the captured function eagerly on replay."""

    def __init__(self) -> None:
        self.fn = None
        self.captures = 0
        self.replays = 0

    def capture(self, fn) -> None:
        self.captures += 1
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.replays += 1
        self.fn()


def stand_in_factory():
    made: list[StandInGraph] = []

    def new_graph() -> StandInGraph:
        made.append(StandInGraph())
        return made[-1]

    return new_graph, made


@pytest.fixture(scope="module")
def tiny_llama():
    folder, _ = save_tiny_model("llama", tie_word_embeddings=False)
    return folder


# ---- buckets ------------------------------------------------------------------------------------


def test_bucket_sizes_are_vllm_like():
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(4096)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 5, 8, 9, 17, 64, 100, 256, 600])
def test_every_batch_size_maps_to_the_smallest_bucket_that_holds_it(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    buckets = GraphBuckets(sizes)
    assert buckets.largest == min(max_num_seqs, MAX_CAPTURE_SIZE)
    for n in range(1, buckets.largest + 1):
        b = buckets.bucket_for(n)
        assert b in sizes and b >= n, (n, b)
        assert not [s for s in sizes if n <= s < b], (n, b)
    assert buckets.bucket_for(0) is None
    assert buckets.bucket_for(buckets.largest + 1) is None


# ---- static buffers and padding, on a recording decode function ----------------------------------


def recording_decode(seen: list[dict]):
    """A decode function that records its inputs and returns hidden rows made from them."""

    def decode(input_ids, positions, slot_mapping, block_tables, context_lens):
        seen.append(
            dict(
                ids=input_ids.tolist(),
                pos=positions.tolist(),
                slots=slot_mapping.tolist(),
                tables=block_tables.tolist(),
                lens=context_lens.tolist(),
            )
        )
        return torch.stack([input_ids.float(), positions.float(), slot_mapping.float()], dim=1)

    return decode


def decode_batch(n: int, base: int):
    """n decoding sequences' inputs: (input_ids, positions, slots, block rows, context lens)."""
    ids = [base + i for i in range(n)]
    pos = [10 + i for i in range(n)]
    rows = [[base + i, base + i + 100][: 1 + i % 2] for i in range(n)]
    slots = [r[-1] * 16 + 3 for r in rows]
    lens = [p + 1 for p in pos]
    return ids, pos, slots, rows, lens


def test_capture_once_per_bucket_and_padding_rows_are_rewritten_every_step():
    seen: list[dict] = []
    new_graph, made = stand_in_factory()
    graphs = DecodeGraphs(
        GraphBuckets((1, 2, 4, 8)),
        recording_decode(seen),
        max_blocks_per_seq=4,
        hidden_size=3,
        dtype=torch.float32,
        device="cpu",
        new_graph=new_graph,
    )
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and len(made) == 4
    assert [len(s["ids"]) for s in seen] == [8, 4, 2, 1]  # largest first
    assert all(set(s["slots"]) == {PAD_SLOT} for s in seen)  # the capture writes no KV
    assert all(g.captures == 1 and g.replays == 0 for g in made)
    with pytest.raises(RuntimeError):
        graphs.capture()

    def step(n: int, base: int) -> dict:
        ids, pos, slots, rows, lens = decode_batch(n, base)
        seen.clear()
        out = graphs.run(ids, pos, slots, rows, lens)
        (s,) = seen  # one replay, of one bucket
        b = graphs.buckets.bucket_for(n)
        assert len(s["ids"]) == b
        assert (s["ids"][:n], s["pos"][:n], s["slots"][:n], s["lens"][:n]) == (ids, pos, slots, lens)
        for row, table in zip(rows, s["tables"][:n]):
            assert table[: len(row)] == row
        # Padding: token 0 at position 0, no KV slot, one token of context in block 0.
        assert s["ids"][n:] == [0] * (b - n) and s["pos"][n:] == [0] * (b - n)
        assert s["slots"][n:] == [PAD_SLOT] * (b - n) and s["lens"][n:] == [1] * (b - n)
        assert all(t == [0] * 4 for t in s["tables"][n:])
        # Only the n real rows come back.
        assert out.shape == (n, 3)
        assert out.tolist() == [[float(i), float(p), float(sl)] for i, p, sl in zip(ids, pos, slots)]
        return s

    step(7, base=1)
    step(5, base=30)  # same bucket: rows 5 and 6, real a step ago, are padding again
    step(3, base=60)
    step(1, base=90)
    step(8, base=5)
    assert {b: g.replays for b, g in graphs.graphs.items()} == {8: 3, 4: 1, 2: 0, 1: 1}
    assert all(g.captures == 1 for g in made) and len(made) == 4

    assert graphs.fits([[1]] * 8) and not graphs.fits([[1]] * 9) and not graphs.fits([])
    assert not graphs.fits([[1, 2, 3, 4, 5]])  # wider than the static block table
    with pytest.raises(ValueError):
        graphs.run(*decode_batch(9, base=1))


# ---- the real model: graph replay on padded buffers against an eager engine -----------------------


def engine_pair(folder, **config):
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=8, **config)
    model_config = ModelConfig.from_model_dir(folder)
    eager = build_engine(model_config, config, iter_safetensors(folder))
    graphed = build_engine(model_config, config, iter_safetensors(folder))
    assert eager.runner.decode_graphs is None and graphed.runner.decode_graphs is None  # the CPU runs eagerly
    new_graph, made = stand_in_factory()
    graphed.runner.capture_decode_graphs(new_graph)
    assert sorted(graphed.runner.decode_graphs.graphs) == [1, 2, 4, 8]
    return eager, graphed, made


def slots_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Cache slots (block * block_size + offset) whose K or V changed in any layer."""
    changed = (before != after).flatten(4).any(-1).any(0).any(0)  # [num_blocks, block_size]
    bs = changed.shape[1]
    return {int(b) * bs + int(o) for b, o in changed.nonzero().tolist()}


@pytest.mark.parametrize("max_num_batched_tokens", [256, 24])  # whole prompts in one step; chunks beside decodes
def test_padded_rows_never_reach_the_sampler_or_the_kv_cache(tiny_llama, max_num_batched_tokens):
    eager, graphed, made = engine_pair(tiny_llama, max_num_batched_tokens=max_num_batched_tokens)
    runner = graphed.runner
    bs = runner.block_size
    steps = {"decode_only": 0, "mixed": 0, "sampled_rows": []}
    real_execute = runner.execute

    def checked_execute(chunks, sample_mask):
        decode_only = all(c.num_tokens == 1 for c in chunks)
        steps["decode_only" if decode_only else "mixed"] += 1
        written = {
            c.seq.block_ids[p // bs] * bs + p % bs
            for c in chunks
            for p in range(c.seq.num_computed_tokens, c.seq.num_computed_tokens + c.num_tokens)
        }
        before = runner.kv_cache.clone()
        logits = real_execute(chunks, sample_mask)
        changed = slots_changed(before, runner.kv_cache)
        assert changed and changed <= written, sorted(changed - written)  # padding rows wrote nothing
        assert logits.shape[0] == sum(sample_mask)
        return logits

    runner.execute = checked_execute
    real_sampler = graphed.sampler

    def checked_sampler(logits, rows):
        assert logits.shape[0] == len(rows)  # one row per sampled sequence, no padding rows
        steps["sampled_rows"].append(len(rows))
        return real_sampler(logits, rows)

    graphed.sampler = checked_sampler

    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((3, 17, 30, 5, 41))]
    # Different lengths: the decode batch shrinks 5, 4, 3, 2, 1 (buckets 8, 4, 4, 2, 1).
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)
        eager.add_request(p, params, request_id=f"r{i}")
        graphed.add_request(p, params, request_id=f"r{i}")
    tokens = {"eager": {}, "graphed": {}}
    while eager.has_unfinished_requests() or graphed.has_unfinished_requests():
        record = {}
        for name, engine in (("eager", eager), ("graphed", graphed)):
            logits_seen = []
            sampler = engine.sampler

            def spy(logits, rows, sampler=sampler, logits_seen=logits_seen):
                logits_seen.append(logits.clone())
                return sampler(logits, rows)

            engine.sampler = spy
            try:
                for out in engine.step():
                    tokens[name].setdefault(out.request_id, []).extend(out.token_ids)
            finally:
                engine.sampler = sampler
            record[name] = logits_seen
        assert len(record["eager"]) == len(record["graphed"])
        for a, b in zip(record["eager"], record["graphed"]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graphed.runner.kv_cache, eager.runner.kv_cache, atol=1e-5, rtol=1e-5)
    assert tokens["graphed"] == tokens["eager"]
    assert [len(tokens["graphed"][f"r{i}"]) for i in range(5)] == [3, 4, 5, 6, 7]

    replays = sum(g.replays for g in made)
    assert replays == steps["decode_only"] > 0  # every decode-only step replayed a graph ...
    assert all(g.captures == 1 for g in made)  # ... captured once, at start-up
    if max_num_batched_tokens == 24:
        assert steps["mixed"] > 1  # chunked prefills beside decodes stayed eager
    else:  # every bucket ran, 8 with three padding rows and 4 with one after a full step
        assert all(g.replays > 0 for g in runner.decode_graphs.graphs.values())


# ---- enforce_eager ------------------------------------------------------------------------------


def test_enforce_eager_and_the_cpu_never_capture(tiny_llama, monkeypatch):
    assert decode_graphs_wanted(False, "cuda", "triton")
    assert not decode_graphs_wanted(True, "cuda", "triton")
    assert not decode_graphs_wanted(False, "cpu", "native")
    assert not decode_graphs_wanted(False, "cpu", "triton")  # the interpreter
    assert not decode_graphs_wanted(False, "cuda:0", "reference")  # host reads of tensor values
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")

    model_config = ModelConfig.from_model_dir(tiny_llama)
    for eager in (False, True):
        config = EngineConfig(num_kv_blocks=16, enforce_eager=eager)
        runner = ModelRunner(model_config, config, iter_safetensors(tiny_llama))
        assert runner.decode_graphs is None  # the CPU, flag or not

    # The start-up path as on CUDA (device check bypassed, stand-in graphs): the flag alone decides.
    new_graph, made = stand_in_factory()
    monkeypatch.setattr(model_runner, "decode_graphs_wanted", lambda enforce_eager, device, backend: not enforce_eager)
    monkeypatch.setattr(model_runner, "cuda_graph_factory", lambda: new_graph)
    runner = ModelRunner(model_config, EngineConfig(num_kv_blocks=16, max_num_seqs=4), iter_safetensors(tiny_llama))
    assert sorted(runner.decode_graphs.graphs) == [1, 2, 4] and [g.captures for g in made] == [1, 1, 1]
    runner = ModelRunner(
        model_config, EngineConfig(num_kv_blocks=16, max_num_seqs=4, enforce_eager=True), iter_safetensors(tiny_llama)
    )
    assert runner.decode_graphs is None and len(made) == 3


def test_enforce_eager_flag():
    from cluster.cli import _parser
    from cluster.config import BatonConfig

    args = vars(_parser().parse_args(["serve", "--enforce-eager"]))
    config = BatonConfig.from_options(**{k: v for k, v in args.items() if k not in ("command", "config", "model_arg")})
    assert config.engine.enforce_eager is True
    assert BatonConfig().engine.enforce_eager is False
