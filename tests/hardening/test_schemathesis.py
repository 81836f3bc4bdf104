"""schemathesis against a real deployment over HTTP, from the OpenAPI schema the router serves:
no 5xx and every answer conforms, for a bounded number of generated requests per operation (each
generating at most 16 tokens, so the run stays short on a CPU). The server is healthy afterwards
and no KV block is left referenced."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.hardening.conftest import ask_good
from tests.hardening.corpus import API_KEY
from tests.hardening.schemathesis_run import CHECKS, MODES, cap_generation

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 15  # per operation and mode


@pytest.fixture(scope="module")
def live_schema(hardened):
    schema = schemathesis.openapi.from_url(hardened.base_url + "/openapi.json")
    schema.config.generation.update(modes=MODES)
    return schema


schema = schemathesis.pytest.from_fixture("live_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_answers_conform_to_the_schema(case):
    cap_generation(case, 16)
    case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=120)


def test_healthy_after_the_fuzzing(hardened, good_answer):
    with hardened.client() as client:
        assert client.get("/health").status_code == 200
        assert ask_good(client).json()["choices"][0]["message"]["content"] == good_answer
    stats = hardened.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in stats.values()), stats
