"""CUDA graphs for decode on a real GPU: a replayed decode step gives the eager step's logits and KV.

The small random Llama of test_e2e_triton_vs_reference (hidden 256, 4 layers, GQA 4:2) runs on
CUDA with the Triton kernels and max_num_seqs 8, so start-up captures buckets 1, 2, 4, 8. Checks:
1. one decode step of 5 sequences (bucket 8: three padding rows), run eagerly and then by graph
   replay from the same KV cache: logits within tolerance (float32: 1e-3, as its attention dots run
   in TF32 and the padded batch may split the decode attention differently, which rounds other
   probabilities to TF32 (an H200 measured 1.3e-4); bfloat16 with an FP8 KV cache: 3e-2, the GEMMs'
   order may differ with the padded batch), the same KV cache (FP8:
   within one e4m3 code), and no slot changed outside the step's own five;
2. float32 greedy generation with graphs against an --enforce-eager engine: the same tokens
   (a divergence only at a near tie, tests/engine/helpers.compare_greedy), the decode batch
   shrinking 5, 4, 3, 2, 1 through the buckets; every decode-only step replayed a graph.
Skipped without CUDA; run by tests/gpu/run.sh (seconds: four small captures per engine).
The bucketing and padding logic itself is tested on the CPU in tests/engine/test_cuda_graph_buckets.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LENS = (3, 17, 30, 5, 41)
NUM_LAYERS = 4


def make_engine(folder, device: str, enforce_eager: bool = False, dtype: str = "float32", kv_cache_dtype: str = "auto"):
    from workers.build import build_engine
    from workers.config import EngineConfig
    from workers.models.checkpoint import iter_safetensors
    from workers.models.config import ModelConfig

    scales = ((0.05, 0.05),) * NUM_LAYERS if kv_cache_dtype == "fp8" else None  # no calibration run needed
    config = EngineConfig(
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_scales=scales,
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enforce_eager=enforce_eager,
    )
    return build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def count_replays(runner) -> dict:
    """Wrap runner.decode_graphs.run to count the steps that replayed a graph."""
    graphs = runner.decode_graphs
    counts = {"replays": 0}
    real_run = graphs.run

    def run(*args, **kwargs):
        counts["replays"] += 1
        return real_run(*args, **kwargs)

    graphs.run = run
    return counts


def slots_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    changed = (before.view(torch.uint8) != after.view(torch.uint8)).flatten(4).any(-1).any(0).any(0)
    bs = changed.shape[1]
    return {int(b) * bs + int(o) for b, o in changed.nonzero().tolist()}


def kv_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of two KV caches: in values, or for FP8 in e4m3 codes (a value whose
    inputs differ in the last bits may round to the neighbouring code; a sign flip counts only
    between the two smallest magnitudes)."""
    if a.dtype != torch.float8_e4m3fn:
        return float((a.float() - b.float()).abs().max())
    ca, cb = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    ma, mb = ca & 0x7F, cb & 0x7F
    same_sign = (ca & 0x80) == (cb & 0x80)
    diff = torch.where(same_sign, (ma - mb).abs(), ma + mb)
    return float(diff.max())


def check_one_step(folder, device: str, dtype: str, kv_cache_dtype: str, tol: float, kv_tol: float) -> None:
    from common.sampling_params import SamplingParams

    engine = make_engine(folder, device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    for i, p in enumerate(prompts()):
        engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
    engine.step()  # every prompt in one prefill step: five sequences decoding
    results = {}
    real_execute = runner.execute

    def compare(chunks, sample_mask):
        assert len(chunks) == 5 and all(c.num_tokens == 1 for c in chunks)
        bs = runner.block_size
        written = {
            c.seq.block_ids[c.seq.num_computed_tokens // bs] * bs + c.seq.num_computed_tokens % bs for c in chunks
        }
        before = runner.kv_cache.clone()
        runner.decode_graphs = None
        eager_logits = real_execute(chunks, sample_mask).clone()
        eager_kv = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)  # in place: the graphs hold its address
        runner.decode_graphs = graphs
        counts = count_replays(runner)
        graph_logits = real_execute(chunks, sample_mask)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        results.update(
            eager=eager_logits.float().cpu(),
            graph=graph_logits.float().cpu(),
            replays=counts["replays"],
            changed=slots_changed(before, runner.kv_cache),
            eager_changed=slots_changed(before, eager_kv),
            kv_error=kv_difference(runner.kv_cache, eager_kv),
            written=written,
        )
        del graphs.run  # back to the class's method
        return graph_logits

    runner.execute = compare
    engine.step()
    assert results["replays"] == 1
    assert results["graph"].shape == results["eager"].shape == (5, 512)
    error = float((results["graph"] - results["eager"]).abs().max())
    print(
        f"{dtype}/{kv_cache_dtype} kv: graph vs eager decode step, max logit error {error:.2e}, "
        f"max KV error {results['kv_error']:.2e}"
    )
    assert error <= tol, error
    assert results["kv_error"] <= kv_tol, results["kv_error"]
    # The padding rows wrote nothing: only the five sequences' new slots changed.
    assert results["changed"] <= results["written"], sorted(results["changed"] - results["written"])
    assert results["eager_changed"] <= results["written"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.gpu.test_e2e_triton_vs_reference import ARCH, write_random_llama

    assert ARCH["num_hidden_layers"] == NUM_LAYERS
    path = tmp_path_factory.mktemp("graph-llama")
    write_random_llama(path)
    return path


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means IEEE float32 here


# (model dtype, KV cache dtype, logits tolerance, KV tolerance: values, or e4m3 codes for FP8)
@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, tol, kv_tol", [("float32", "auto", 1e-3, 1e-4), ("bfloat16", "fp8", 3e-2, 1)]
)
def test_graph_replayed_decode_step_matches_the_eager_step(folder, dtype, kv_cache_dtype, tol, kv_tol):
    check_one_step(folder, "cuda", dtype, kv_cache_dtype, tol, kv_tol)


def check_generation(folder, device: str) -> None:
    from common.sampling_params import SamplingParams
    from tests.engine.helpers import Reference, compare_greedy

    eager = make_engine(folder, device, enforce_eager=True)
    assert eager.runner.decode_graphs is None
    graphed = make_engine(folder, device)
    counts = count_replays(graphed.runner)
    steps = {"decode_only": 0}
    real_execute = graphed.runner.execute

    def counting(chunks, sample_mask):
        steps["decode_only"] += all(c.num_tokens == 1 for c in chunks)
        return real_execute(chunks, sample_mask)

    graphed.runner.execute = counting
    done, logits = {}, {}
    for name, engine in (("eager", eager), ("graphed", graphed)):
        recorded: dict[str, list[torch.Tensor]] = {}
        real_sampler = engine.sampler

        def recording(lgts, rows, recorded=recorded, real_sampler=real_sampler):
            for row_logits, row in zip(lgts, rows):
                recorded.setdefault(tuple(row.prompt_token_ids), []).append(row_logits.float().cpu())
            return real_sampler(lgts, rows)

        engine.sampler = recording
        tokens: dict[str, list[int]] = {}
        # Different max_tokens per request: the decode batch shrinks 5, 4, 3, 2, 1.
        for i, p in enumerate(prompts()):
            engine.add_request(
                p, SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True), request_id=f"r{i}"
            )
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        engine.sampler = real_sampler
        done[name] = tokens
        logits[name] = recorded
    diverged = []
    for i, p in enumerate(prompts()):
        ref = Reference(done["eager"][f"r{i}"], logits["eager"][tuple(p)])
        cmp = compare_greedy(done["graphed"][f"r{i}"], ref, logits["graphed"][tuple(p)])
        print(f"prompt {i}: diverged_at={cmp.diverged_at} max_logit_error={cmp.max_logit_error:.2e}")
        diverged += [i] if cmp.diverged_at is not None else []
    assert len(diverged) <= 1, diverged
    assert counts["replays"] == steps["decode_only"] > 0


def test_greedy_generation_with_graphs_matches_enforce_eager(folder):
    check_generation(folder, "cuda")
