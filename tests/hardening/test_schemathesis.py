"""schemathesis against a real deployment over HTTP: no 5xx and every answer conforms to the
OpenAPI schema, for a bounded number of generated requests per operation (each generating at most
16 tokens, so the run stays short on a CPU). The server is healthy afterwards and no KV block is
left referenced.

The schema is built at import time from an app over a FakeBackend (schemathesis parametrizes
tests when they are collected, before the deployment exists); the first test checks it is exactly
the schema the deployment serves.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from router.app import build_app
from router.config import ServerConfig
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from tests.hardening.conftest import ask_good
from tests.hardening.corpus import API_KEY
from tests.hardening.schemathesis_run import CHECKS, MODES, cap_generation
from workers.models.files import resolve_model_dir

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 25  # per operation and mode


def _served_schema() -> dict:
    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    app = build_app(
        FakeBackend(tokenizer), tokenizer, "SmolLM2-135M-Instruct", 4096, server=ServerConfig(api_key=API_KEY)
    )
    return app.openapi()


SCHEMA = _served_schema()
schema = schemathesis.openapi.from_dict(SCHEMA)
schema.config.generation.update(modes=MODES)


def test_the_deployment_serves_this_schema(hardened):
    assert httpx.get(hardened.base_url + "/openapi.json").json() == SCHEMA


@schema.parametrize()
# derandomize: the same examples on every run, so CI and a developer see the same result.
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_answers_conform_to_the_schema(case, hardened):
    cap_generation(case, 16)
    case.call_and_validate(
        base_url=hardened.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=120
    )


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "Paris is", "max_tokens": 4, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
    ],
)
def test_every_event_of_a_stream_conforms_to_the_schema(hardened, path, body):
    # The fuzzer reaches a 200 stream only now and then (most generated bodies are refused), so a
    # stream from each endpoint is checked here every run: each event, then `[DONE]`.
    case = schema[path]["POST"].Case(body={"model": "SmolLM2-135M-Instruct", **body})
    response = case.call_and_validate(
        base_url=hardened.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=120
    )
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")


def test_healthy_after_the_fuzzing(hardened, good_answer):
    with hardened.client() as client:
        assert client.get("/health").status_code == 200
        assert ask_good(client).json()["choices"][0]["message"]["content"] == good_answer
    stats = hardened.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in stats.values()), stats
