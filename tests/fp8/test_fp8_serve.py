"""`baton serve --quantization fp8 --kv-cache-dtype fp8` end to end: Ray on 127.0.0.1, a prefill
and a decode worker with FP8 weights and FP8 KV, the router on a free port, one chat request.

Oracle: the engine alone in this process with the same FP8 configuration must give the same
greedy answer (the handoff moved FP8 blocks and both workers use identical scales); the float32
engine's answer is the accuracy reference, compared token by token.
"""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from testkit.cluster import leave_ray, serving
from testkit.harness import free_port
from workers.build import load_engine
from workers.config import EngineConfig

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_cli_accepts_fp8_flags():
    from cluster.cli import _parser
    from cluster.config import BatonConfig

    args = vars(_parser().parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    options = {k: v for k, v in args.items() if k not in ("command", "config", "model_arg")}
    config = BatonConfig.from_options(**options).engine
    assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--quantization", "int4"])


def test_serve_fp8_answers_like_the_fp8_engine_and_reports_float32_agreement():
    import openai

    from cluster.config import BatonConfig
    from router.tokenizer import Tokenizer
    from workers.models.files import resolve_model_dir

    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(quiet=True))
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    fp8 = load_engine(None, EngineConfig(kv_cache_memory=32 << 20, quantization="fp8", kv_cache_dtype="fp8"))
    [want] = fp8.generate([prompt], params)
    del fp8
    [ref] = load_engine(None, EngineConfig(kv_cache_memory=32 << 20)).generate([prompt], params)

    config = BatonConfig.from_options(
        port=free_port(),
        kv_cache_memory="32MiB",
        max_num_seqs=8,
        quantization="fp8",
        kv_cache_dtype="fp8",
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
    )
    leave_ray()  # a private Ray of this test's own, which the deployment shuts down after it
    with serving(config, actor_name_prefix="baton-fp8") as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0, max_tokens=24
        )
        stats = running.stats()
    assert reply.choices[0].message.content == want.text
    # The request crossed the FP8 handoff: bytes per prompt token are the FP8 size
    # (2 x 30 layers x 3 KV heads x 64 head_dim x 1 byte, whole blocks).
    sent = sum(s.kv_bytes_sent for s in stats.values())
    assert sent > 0 and sent % (2 * 30 * 3 * 64 * 16) == 0
    agree = next((i for i, (a, b) in enumerate(zip(want.token_ids, ref.token_ids)) if a != b), len(ref.token_ids))
    print(
        f"\nfp8 serve: {reply.choices[0].message.content!r}; float32: {ref.text!r}; "
        f"identical first {agree} of {len(ref.token_ids)} tokens"
    )
    assert "Paris" in want.text
