"""Speculative decoding on the Triton kernels (interpreter, CPU tensors): a verification chunk runs
through the Triton paged prefill attention over a cached context, and the greedy tokens are those of
the same Triton engine without speculation.

TRITON_INTERPRET must be set before Triton is imported (see test_triton_path.py): the engines run
in this process when the session's Triton interprets (tests/conftest.py sets it), else in a child
Python with it set, which prints its findings as JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import kernels.prefill_attention as prefill
from common.sampling_params import SamplingParams
from tests.engine.helpers import interpreter_ready, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig

pytestmark = pytest.mark.slow  # speculative engines on the Triton kernels in the interpreter: about 4 s here

REPO = Path(__file__).resolve().parents[2]


def speculation_on_triton() -> dict:
    """The tiny Llama on the Triton kernels, without and with n-gram speculation: its tokens, the
    drafts accepted, and how many prefill-attention calls were verification chunks."""
    folder, _ = save_tiny_model("llama")
    calls = {"verify": 0}
    real = prefill.paged_prefill_attention_triton

    def spy(*args, **kwargs):
        qsl, ctx = args[4].tolist(), args[5].tolist()
        # A verification chunk: a short query span (last token + drafts) over a longer cached context.
        calls["verify"] += any(1 < b - a <= 5 and c > b - a for a, b, c in zip(qsl, qsl[1:], ctx))
        return real(*args, **kwargs)

    rng = random.Random(0)
    prompts = []
    for _ in range(2):
        passage = [rng.randrange(3, 512) for _ in range(8)]
        prompts.append(passage * 3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    prefill.paged_prefill_attention_triton = spy
    try:
        for name, spec in (("plain", None), ("spec", '{"method": "ngram", "num_speculative_tokens": 3}')):
            config = EngineConfig(kernel_backend="triton", kv_cache_memory=4 << 20, speculative_config=spec)
            engine = build_engine(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
            out[name] = [c.token_ids for c in engine.generate(prompts, params)]
            out[name + "_accepted"] = engine.stats().spec_decode.num_accepted_tokens
            out[name + "_verify_calls"], calls["verify"] = calls["verify"], 0
    finally:
        prefill.paged_prefill_attention_triton = real
    return out


CHILD = (
    "import json; from tests.engine.test_speculative_triton import speculation_on_triton as run; "
    "print('RESULT ' + json.dumps(run()))"
)


def test_greedy_tokens_on_the_triton_kernels_are_those_without_speculation():
    if interpreter_ready():  # the session's Triton interprets (tests/conftest.py)
        out = speculation_on_triton()
    else:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["spec_accepted"] > 0 and out["spec_verify_calls"] > 0 and out["plain_verify_calls"] == 0
    assert out["spec"] == out["plain"]
