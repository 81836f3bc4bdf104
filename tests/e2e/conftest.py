"""Real deployments for end-to-end tests: Ray on 127.0.0.1, prefill and decode actors, the router on a free port.

The deployments this process runs share one private Ray (`deployment_ray`): a Ray of
their own each cost about 3.5 s of the two cores to start and stop. The folder is a package so
that this Ray ends with it (`_no_ray_after_the_folder`); a test that runs `baton serve` (a Ray
of its own) ends it first (`no_driver_ray`), so that it does not idle beside that server.
"""

from __future__ import annotations

import pytest

from testkit.cluster import leave_ray, serving
from testkit.harness import free_port


@pytest.fixture(scope="package", autouse=True)
def _no_ray_after_the_folder():
    yield
    leave_ray()


@pytest.fixture(scope="module")
def deployment_ray():
    """This process's private Ray (namespace "baton", as a deployment starts its own): the first
    test that asks starts it, later ones reuse it. Deployments in it need actor name prefixes of
    their own (testkit.cluster.serving's actor_name_prefix): a killed actor's name is freed
    asynchronously, and the next module's deployment could find it still taken."""
    from cluster.launcher import start_ray

    start_ray(None)  # nothing when this process is already a Ray driver


@pytest.fixture(scope="module")
def no_driver_ray():
    """No Ray of this process's own beside a `baton serve` test (it starts its own)."""
    leave_ray()


@pytest.fixture(scope="module")
def server(deployment_ray):
    from cluster.config import BatonConfig

    # local_prefill_threshold=0: these tests check the prefill -> decode handoff, so every request
    # goes through it (the kv-aware default would prefill their short prompts on the decode worker).
    config = BatonConfig.from_options(
        port=free_port(),
        kv_cache_memory="192MiB",
        max_num_seqs=64,
        local_prefill_threshold=0,
        prefill_queue_threshold=10**6,
    )
    with serving(config, actor_name_prefix="e2e") as running:
        yield running


@pytest.fixture(scope="session")
def reference_engine():
    """The engine alone, in this process: what every HTTP answer must equal (greedy)."""
    from workers.build import load_engine
    from workers.config import EngineConfig

    return load_engine(None, EngineConfig(kv_cache_memory=192 << 20))


@pytest.fixture(scope="session")
def tokenizer():
    from router.tokenizer import Tokenizer
    from workers.models.files import resolve_model_dir

    return Tokenizer.from_model_dir(resolve_model_dir(quiet=True))


@pytest.fixture(scope="session")
def greedy_answers_match(tokenizer):
    """check(base_url, engine, near_tie=0.0): two greedy chat answers and a streamed completion from
    the server at base_url equal `engine`'s, over the official openai client.

    With near_tie > 0 an answer may leave the engine's at a step where the engine's top-2 logit gap
    is below it (and is not checked after): a server whose layers sum in another order (other
    tensor-parallel sizes) through an FP8 KV cache can turn such a tie the other way."""
    import openai
    import torch

    from common.sampling_params import SamplingParams
    from tests.engine.helpers import run_with_logits

    def expect(engine, prompt: list[int], max_tokens: int, answer: str, near_tie: float) -> None:
        [want], [logits] = run_with_logits(engine, [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        if answer == want.text:
            return
        ids = want.token_ids
        step = next((i for i in range(len(ids)) if not answer.startswith(tokenizer.decode(ids[: i + 1]))), len(ids))
        top2 = torch.topk(logits[min(step, len(ids) - 1)].float(), 2).values
        gap = float(top2[0] - top2[1])
        assert step < len(ids) and gap < near_tie, (
            f"{answer!r} != {want.text!r}: they part at step {step}, where the engine's top-2 gap is {gap:.3f}"
            f" (allowed below {near_tie})"
        )

    def check(base_url: str, engine, near_tie: float = 0.0) -> None:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused")
        for question in ["What is the capital of France?", "Write a haiku about the sea."]:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
            reply = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                temperature=0,
                max_tokens=16,
                messages=[{"role": "user", "content": question}],
            )
            expect(engine, prompt, 16, reply.choices[0].message.content, near_tie)
        prompt = "The three primary colors are"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt, temperature=0, max_tokens=20, stream=True
            )
            if c.choices
        )
        expect(engine, tokenizer.encode(prompt), 20, streamed, near_tie)

    return check
