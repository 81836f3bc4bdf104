"""LoRA adapters over HTTP with the official openai client: a real deployment (a prefill and a
decode worker on Ray, every request through the KV handoff) serving a tiny random Llama with two
adapters from --lora-modules and one loaded while serving. Oracle: transformers + peft's greedy
tokens on the same weights. /v1/models lists the adapters as vLLM does; unknown models are 404 and
bad adapters 400, with the OpenAI error envelope; the server stays healthy through all of it."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
import torch

from tests.engine.helpers import hf_greedy, save_lora_adapter, save_tiny_model, write_word_tokenizer

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")

NEW_TOKENS = 8
ADAPTERS = {"sql": (4, 8, ["q_proj", "v_proj"]), "chat": (8, 16, ["o_proj", "gate_proj", "down_proj"])}
LATE = ("late", (16, 16, ["k_proj", "up_proj"]))


def _peft_greedy(hf, folder: Path, prompt: list[int]) -> list[int]:
    model = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    try:
        with torch.inference_mode():
            return hf_greedy(model, prompt, NEW_TOKENS).token_ids
    finally:
        model.unload()


def _tokens(choice) -> list[int]:
    return [int(t.removeprefix("t")) for t in choice.logprobs.tokens]


def test_adapters_over_http_match_peft_and_bad_ones_are_refused(deployment_ray, monkeypatch):
    from cluster.config import BatonConfig
    from testkit.cluster import serving
    from testkit.harness import free_port

    folder, hf = save_tiny_model("llama", tie_word_embeddings=False)
    write_word_tokenizer(folder)
    hf.generation_config.eos_token_id = None
    root = Path(tempfile.mkdtemp(prefix="baton-lora-serve-"))
    try:
        for seed, (name, (rank, alpha, targets)) in enumerate([*ADAPTERS.items(), LATE]):
            save_lora_adapter(hf, root / name, rank, alpha, targets, seed)
        monkeypatch.setenv("BATON_ALLOW_RUNTIME_LORA_UPDATING", "1")
        config = BatonConfig.from_options(
            model=folder,
            port=free_port(),
            kv_cache_memory="16MiB",
            max_num_batched_tokens=16,
            local_prefill_threshold=0,
            prefill_queue_threshold=10**6,
            enable_lora=True,
            lora_modules="\n".join(f"{n}={root / n}" for n in ADAPTERS),
            max_loras=2,
        )
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(12, 30))] for _ in range(2)]
        with serving(config, actor_name_prefix="lora-serve") as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
            base_name = Path(folder).name  # the served model's name: its folder's
            models = {m.id: m for m in client.models.list().data}
            assert set(models) == {base_name, "sql", "chat"}
            assert models["sql"].parent == base_name and models["sql"].root == str(root / "sql")

            def complete(model: str, prompt: list[int]):
                return client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    logprobs=1,
                    extra_body={"ignore_eos": True},
                ).choices[0]

            for prompt in prompts:
                with torch.inference_mode():
                    base = hf_greedy(hf, prompt, NEW_TOKENS).token_ids
                assert _tokens(complete(base_name, prompt)) == base
                for name in ADAPTERS:
                    ours = _tokens(complete(name, prompt))
                    assert ours == _peft_greedy(hf, root / name, prompt)
                    assert ours != base  # the adapter was applied, on the prefill worker and the decode worker
            assert server.deployment.backend.counters["remote_prefill"] == len(prompts) * 3

            with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
                complete("nope", prompts[0])
            late_name, (rank, _, _) = LATE
            with pytest.raises(openai.NotFoundError):
                complete(late_name, prompts[0])

            url = server.base_url + "/v1"
            r = httpx.post(
                f"{url}/load_lora_adapter", json={"lora_name": late_name, "lora_path": str(root / late_name)}
            )
            assert r.status_code == 200, r.text
            assert _tokens(complete(late_name, prompts[0])) == _peft_greedy(hf, root / late_name, prompts[0])
            assert late_name in {m.id for m in client.models.list().data}

            refused = [
                ({"lora_name": "sql", "lora_path": str(root / "sql")}, 400, "already been loaded"),
                ({"lora_name": "missing", "lora_path": str(root / "missing")}, 400, "not a PEFT adapter folder"),
                ({"lora_path": str(root / "sql")}, 400, "lora_name is required"),
            ]
            for body, status, message in refused:
                r = httpx.post(f"{url}/load_lora_adapter", json=body)
                assert r.status_code == status and message in r.json()["error"]["message"], r.text
            r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "nope"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
            r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": late_name})
            assert r.status_code == 200, r.text
            with pytest.raises(openai.NotFoundError):
                complete(late_name, prompts[0])

            assert httpx.get(server.base_url + "/health").status_code == 200
            metrics = httpx.get(server.base_url + "/metrics").text
            assert 'baton:lora_requests_total{lora_name="sql"' in metrics
            assert "baton:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    finally:
        shutil.rmtree(root, ignore_errors=True)
