"""The bad-request corpus against a real deployment (Ray, a prefill and a decode worker).

Each bad request must get its status, the OpenAI envelope and the field named; after each, the
server must be healthy and a good request must get exactly the engine's own greedy answer (the
oracle: LLMEngine in this process, no Ray, no HTTP). Afterwards no KV block is left referenced in
either pool.
"""

from __future__ import annotations

import httpx
import pytest

from tests.hardening.conftest import ask_good
from tests.hardening.corpus import check_answer, corpus, send, worker_refusals

pytestmark = pytest.mark.slow


def test_every_bad_request_is_refused_and_the_server_stays_correct(hardened, good_answer):
    # `raw` sends only the headers each case gives (its key, or none); `client` always the key.
    with hardened.client() as client, httpx.Client(base_url=hardened.base_url, timeout=120) as raw:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        assert len(corpus(max_model_len)) >= 50
        cases = corpus(max_model_len) + worker_refusals()  # these reach a worker, which refuses them
        failures = []
        for case in cases:
            try:
                check_answer(case, send(raw, case))
                assert client.get("/health").status_code == 200, "unhealthy after"
                r = ask_good(client)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == good_answer, r.json()
            except AssertionError as e:
                failures.append(f"{case.name}: {e}")
    assert not failures, "\n".join(failures)
    stats = hardened.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in stats.values()), stats
