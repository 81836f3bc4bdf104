"""The whole engine on the Triton kernels (interpreter, CPU tensors) matches the PyTorch reference path.

A tiny random Llama with GQA runs prefill and decode steps twice, once with
EngineConfig(kernel_backend="triton") and TRITON_INTERPRET=1 (every op the model calls is its
Triton kernel, run by the Triton interpreter) and once with kernel_backend="reference". Rule:
identical greedy tokens, and the logits of every step within LOGIT_ATOL (both paths are float32;
only the summation order differs). The kernels are chosen when the engine is built, after the
Spy below has wrapped them.

TRITON_INTERPRET, though, must be set before `triton` is imported: Triton's own jitted library
functions (tl.sum, tl.max, ...) are built as interpreted or compiled functions at import time, and
a kernel interpreted after a non-interpreting import fails with "Cannot call @triton.jit'd outside
of the scope of a kernel" (kernels._triton_compat's late jitting covers only our own kernels).
So when this process imported Triton without the interpreter (the usual case: the engine imports
it at collection), the module runs once in a child pytest with TRITON_INTERPRET=1 and each test
here checks its own outcome there.

Cases: a plain batch of prompts straddling block boundaries (head_dim 16 and 64); and a chunked
prefill with a prefix-cache hit, where the prefill kernel reads a cached prefix and a step mixes
decodes with a prefill chunk. Shapes stay tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.engine.helpers import interpreter_ready, run_with_logits, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

pytestmark = pytest.mark.slow  # an engine on every Triton kernel in the interpreter: about 4 s here

pytest.importorskip("triton")

LOGIT_ATOL = 1e-5  # float32 on both paths; observed differences are below 1e-6

MODELS = {
    # hidden 64, 4 query heads, 2 KV heads: head_dim 16, GQA 2
    "hd16-gqa2": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # hidden 128, 2 query heads, 1 KV head: head_dim 64, GQA 2 (the common serving head size)
    "hd64-gqa2": dict(
        hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True
    ),
}

TRITON_FNS = {
    "rms_norm": ("kernels.rms_norm", "rms_norm_triton"),
    "rotary": ("kernels.rotary", "rotary_embedding_triton"),
    "silu_mul": ("kernels.silu_mul", "silu_and_mul_triton"),
    "store_kv": ("kernels.kv_store", "store_kv_triton"),
    "decode_attention": ("kernels.decode_attention", "paged_decode_attention_triton"),
    "prefill_attention": ("kernels.prefill_attention", "paged_prefill_attention_triton"),
}


CHILD_ENV = "BATON_TRITON_PATH_CHILD"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def child_outcomes(tmp_path_factory):
    """Run this module in a child pytest with TRITON_INTERPRET=1; {test name: (passed, report)}."""
    report = tmp_path_factory.mktemp("triton-path") / "junit.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--junitxml={report}", __file__],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not report.exists():
        pytest.fail(
            f"child pytest wrote no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = (not bad, "\n".join((e.get("message") or "") + "\n" + (e.text or "") for e in bad))
    outcomes["__output__"] = (True, proc.stdout[-2000:])
    return outcomes


@pytest.fixture(autouse=True)
def in_interpreter(request):
    """Yields True to run the test body here; otherwise checks the test's outcome in the child and yields False."""
    if interpreter_ready():
        yield True
        return
    assert not os.environ.get(CHILD_ENV), "child pytest imported Triton without the interpreter"
    passed, report = request.getfixturevalue("child_outcomes").get(request.node.name, (False, "not run in the child"))
    assert passed, f"{request.node.name} in the TRITON_INTERPRET=1 child:\n{report}"
    yield False


@pytest.fixture(scope="module")
def tiny_models():
    return {name: save_tiny_model("llama", **overrides)[0] for name, overrides in MODELS.items()}


class Spy:
    """Counts Triton kernel calls; records prefill calls whose context exceeds the query (a cached prefix)."""

    def __init__(self, monkeypatch):
        import importlib

        self.calls = {name: 0 for name in TRITON_FNS}
        self.prefill_with_prefix = 0
        for name, (module_name, attr) in TRITON_FNS.items():
            module = importlib.import_module(module_name)
            monkeypatch.setattr(module, attr, self._wrap(name, getattr(module, attr)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls[name] += 1
            if name == "prefill_attention":
                qsl, ctx = args[4].tolist(), args[5].tolist()
                qlens = [b - a for a, b in zip(qsl, qsl[1:])]
                self.prefill_with_prefix += any(c > q for c, q in zip(ctx, qlens))
            return fn(*args, **kwargs)

        return wrapper


def triton_engine(folder, **config) -> LLMEngine:
    engine = build_engine(ModelConfig.from_model_dir(folder), EngineConfig(**config), iter_safetensors(folder))
    steps: list[list[tuple[int, bool]]] = []  # per model step: (num_tokens, is_decode) per chunk
    real_execute = engine.runner.execute

    def execute(chunks, sample_mask):
        steps.append([(c.num_tokens, c.seq.num_computed_tokens >= c.seq.num_prompt_tokens) for c in chunks])
        return real_execute(chunks, sample_mask)

    engine.runner.execute = execute
    engine.steps = steps
    return engine


def assert_same(triton_run, reference_run) -> float:
    """Same tokens, same number of sampled steps, logits within LOGIT_ATOL; returns the max logit error."""
    (t_done, t_logits), (r_done, r_logits) = triton_run, reference_run
    worst = 0.0
    for i, (t, r, tl_, rl) in enumerate(zip(t_done, r_done, t_logits, r_logits)):
        assert t.token_ids == r.token_ids, f"request {i}: triton {t.token_ids} vs reference {r.token_ids}"
        assert t.num_cached_tokens == r.num_cached_tokens
        assert len(tl_) == len(rl) == len(r.token_ids)
        for step, (a, b) in enumerate(zip(tl_, rl)):
            err = float((a - b).abs().max())
            assert err < LOGIT_ATOL, f"request {i} step {step}: logits differ by {err:.2e}"
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("model", list(MODELS))
def test_batch_prefill_and_decode_match_reference(model, in_interpreter, request, monkeypatch):
    if not in_interpreter:
        return  # checked in the child
    tiny_models = request.getfixturevalue("tiny_models")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 8, 13)]  # block_size 8: below, at, past
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("reference", "triton"):
        spy = Spy(monkeypatch)
        engine = triton_engine(
            tiny_models[model], kernel_backend=mode, block_size=8, num_kv_blocks=32, max_num_batched_tokens=64
        )
        with torch.inference_mode():
            runs[mode] = run_with_logits(engine, prompts, params)
        if mode == "triton":
            assert all(spy.calls.values()), spy.calls
            # first step: three prompts prefilled together; then decode-only steps
            assert engine.steps[0] == [(3, False), (8, False), (13, False)]
            assert all(all(dec for _, dec in s) for s in engine.steps[1:])
        else:
            assert not any(spy.calls.values()), spy.calls
    worst = assert_same(runs["triton"], runs["reference"])
    print(f"{model}: max logit difference {worst:.2e}")


def test_chunked_prefill_prefix_cache_and_mixed_batch(in_interpreter, request, monkeypatch):
    """Request A (20 tokens) is prefilled in chunks of 16 + 4; its two full blocks stay cached.
    Then D (6 tokens) and B (A's first 16 tokens + 30 new) arrive together: B hits the prefix cache
    for 16 tokens, and while D decodes, B's remaining tokens come in chunks in the same steps."""
    if not in_interpreter:
        return  # checked in the child
    tiny_models = request.getfixturevalue("tiny_models")
    rng = random.Random(5)
    a = [rng.randrange(3, 512) for _ in range(20)]
    d = [rng.randrange(3, 512) for _ in range(6)]
    b = a[:16] + [rng.randrange(3, 512) for _ in range(30)]
    runs = {}
    for mode in ("reference", "triton"):
        spy = Spy(monkeypatch)
        engine = triton_engine(
            tiny_models["hd16-gqa2"], kernel_backend=mode, block_size=8, num_kv_blocks=32, max_num_batched_tokens=16
        )
        with torch.inference_mode():
            first = run_with_logits(engine, [a], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            second = run_with_logits(engine, [d, b], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        runs[mode] = (first[0] + second[0], first[1] + second[1])
        assert second[0][1].num_cached_tokens == 16  # B reused A's two full blocks
        steps = engine.steps
        assert steps[0] == [(16, False)] and steps[1] == [(4, False)]  # A: chunked prefill
        mixed = [s for s in steps if any(dec for _, dec in s) and any(n > 1 for n, _ in s)]
        assert mixed, steps  # D decoding while B prefills a chunk
        if mode == "triton":
            assert all(spy.calls.values()), spy.calls
            assert spy.prefill_with_prefix >= 3, spy.prefill_with_prefix  # A's 2nd chunk, B's chunks
    worst = assert_same(runs["triton"], runs["reference"])
    print(f"chunked + prefix + mixed: max logit difference {worst:.2e}")
