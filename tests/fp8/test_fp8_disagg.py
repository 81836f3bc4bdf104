"""FP8 KV across the prefill -> decode handoff: two EngineWorkers in this process, shared-memory transport.

Checks: the decode worker continues from FP8 blocks exactly as one engine with an FP8 cache
would (the bytes and their scales arrived intact); bytes sent per prompt token are a quarter of
float32 and half of bfloat16; and workers whose KV dtype or scales differ refuse to pair,
naming the field.
"""

from __future__ import annotations

import time

import pytest

from common.sampling_params import SamplingParams
from testkit import workers as calls
from tests.engine.helpers import save_tiny_model
from workers.build import load_engine
from workers.config import EngineConfig
from workers.shell.worker import EngineWorker, WorkerConfig

PROMPT = list(range(5, 69))  # 64 tokens: 4 whole blocks of 16, so bytes / token has no rounding
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama():
    folder, _ = save_tiny_model("llama", tie_word_embeddings=True)
    return folder


def _pair(folder, p_config: EngineConfig, d_config: EngineConfig):
    P = EngineWorker(WorkerConfig("p0", "prefill", folder, p_config, transport="shm"))
    try:
        D = EngineWorker(WorkerConfig("d0", "decode", folder, d_config, transport="shm"))
    except BaseException:
        P.shutdown()
        raise
    return P, D


def _disaggregated(P, D, request_id: str) -> tuple[list[int], int]:
    r = calls.reserve(D, request_id, PROMPT, PARAMS)
    res = calls.prefill(P, request_id, PROMPT, PARAMS, D.endpoint(), r)
    calls.start_decode(D, request_id, res.output.token_ids[0])
    tokens = list(res.output.token_ids)
    deadline = time.monotonic() + 60
    while True:
        outs = [o for o in D.poll_outputs(0.5) if o.request_id == request_id]
        tokens += [t for o in outs for t in o.token_ids]
        if any(o.finished for o in outs):
            return tokens, res.bytes_sent
        assert time.monotonic() < deadline, "decode did not finish"


def test_fp8_kv_handoff_is_exact_and_moves_a_quarter_of_float32(tiny_llama):
    sent = {}
    for name, config in {
        "float32": EngineConfig(num_kv_blocks=32),
        "bfloat16": EngineConfig(num_kv_blocks=32, dtype="bfloat16"),
        "fp8": EngineConfig(num_kv_blocks=32, kv_cache_dtype="fp8"),
    }.items():
        P, D = _pair(tiny_llama, config, config)
        try:
            tokens, nbytes = _disaggregated(P, D, f"r-{name}")
            stats = P.stats()
            assert stats.kv_bytes_sent == nbytes
            sent[name] = stats.kv_bytes_sent / stats.prompt_tokens
            if name == "fp8":
                # Both workers calibrated the same scales, and the layout carries them.
                assert P.engine.runner.kv_scales == D.engine.runner.kv_scales
                assert P.transport.endpoint().layout.kv_scales == P.engine.runner.kv_scales
                # Oracle: one engine with the same FP8 cache, no handoff.
                alone = load_engine(tiny_llama, config).generate([PROMPT], PARAMS)[0].token_ids
                assert tokens == alone
        finally:
            P.shutdown()
            D.shutdown()
    # 2 (K, V) x 2 layers x 2 KV heads x 16 head_dim = 128 elements per token.
    assert sent == {"float32": 128 * 4, "bfloat16": 128 * 2, "fp8": 128 * 1}


@pytest.mark.parametrize(
    "decode_config, field",
    [
        (EngineConfig(num_kv_blocks=32), "dtype local='float8_e4m3fn' peer='float32'"),
        (
            EngineConfig(num_kv_blocks=32, kv_cache_dtype="fp8", kv_scales=((0.5, 0.5), (0.5, 0.5))),
            "kv_scales differ at layer 0",
        ),
    ],
)
def test_workers_with_different_kv_dtype_or_scales_refuse_to_pair(tiny_llama, decode_config, field):
    P, D = _pair(tiny_llama, EngineConfig(num_kv_blocks=32, kv_cache_dtype="fp8"), decode_config)
    try:
        r = calls.reserve(D, "bad", PROMPT, PARAMS)
        # The handoff's handshake refuses the pair (KVLayoutMismatch): the prefill ends as PrefillFailed.
        with pytest.raises(calls.PrefillError, match=f"KV layout mismatch.*{field}"):
            calls.prefill(P, "bad", PROMPT, PARAMS, D.endpoint(), r)
        calls.abort(D, "bad")
        # Nothing leaked on either side.
        assert P.stats().num_free_blocks == P.stats().num_blocks
        assert D.stats().num_free_blocks == D.stats().num_blocks
    finally:
        P.shutdown()
        D.shutdown()
