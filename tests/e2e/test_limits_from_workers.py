"""`baton serve --kv-cache-memory 32MiB`: the router learns the context limit from the workers.

The engine caps max_model_len by what its KV cache holds. The oracle for that number is computed
here by hand from the model's config.json: bytes per token = layers * 2 (K and V) * KV heads *
head dim * 4 (float32), whole blocks of 16 tokens. A prompt over it must get a 400 naming both
numbers from the router (not a failure inside a worker), the server must stay healthy, and
/v1/models must report the same limit.
"""

from __future__ import annotations

import json

import httpx
import pytest

from testkit.harness import baton_serve

pytestmark = pytest.mark.slow

KV_CACHE_MEMORY = 32 << 20
BLOCK_SIZE = 16


def expected_max_model_len() -> int:
    from workers.models.files import resolve_model_dir

    config = json.loads((resolve_model_dir(None, quiet=True) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    bytes_per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4
    blocks = KV_CACHE_MEMORY // (bytes_per_token * BLOCK_SIZE)
    return min(blocks * BLOCK_SIZE, config["max_position_embeddings"])


@pytest.fixture(scope="module")
def small_cache_server(no_driver_ray):
    # Stopped as an operator stops it (SIGTERM to the server: it takes down its workers and private
    # Ray), then whatever is left of its process group is killed: testkit.harness.stop_process.
    with baton_serve(["--kv-cache-memory", "32MiB", "--log-level", "warning"], ready_timeout_s=180) as server:
        yield server.base_url


def test_prompt_over_the_kv_capacity_gets_a_400_naming_the_limit(small_cache_server):
    limit = expected_max_model_len()
    models = httpx.get(small_cache_server + "/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == limit

    prompt_ids = [1000 + i % 500 for i in range(limit + 50)]
    r = httpx.post(
        small_cache_server + "/v1/completions",
        timeout=60,
        json={"model": models["data"][0]["id"], "prompt": prompt_ids, "max_tokens": 4},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] and error["param"] == "prompt"
    assert str(limit) in error["message"] and str(len(prompt_ids)) in error["message"]

    r = httpx.post(
        small_cache_server + "/v1/completions",
        timeout=60,
        json={"prompt": prompt_ids[: limit // 2], "max_tokens": limit},
    )
    assert r.status_code == 400 and str(limit) in r.json()["error"]["message"]

    assert httpx.get(small_cache_server + "/health", timeout=10).status_code == 200
    r = httpx.post(
        small_cache_server + "/v1/completions",
        timeout=120,
        json={"prompt": prompt_ids[: limit - 20], "max_tokens": 8, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == limit - 20
