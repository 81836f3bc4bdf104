"""The short soak (bench/soak.py, 20 s of load) against the hardening deployment.

Calibrates the sustainable throughput, offers 80% of it with 10% of clients disconnecting
mid-stream, some giving up before the first token and some oversized requests; then no KV block
may be left referenced in either pool, nothing may be left in the router's gates, no process may
have grown by 5% or more after warm-up, and no error may be one that was not intended.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hardening.conftest import ask_good
from tests.hardening.corpus import API_KEY, MAX_REQUEST_BODY

pytestmark = pytest.mark.slow


def test_short_soak_leaves_no_leak_and_no_unintended_error(hardened, good_answer, tmp_path):
    # The benchmark as its users run it (`python -m bench.soak`), in a process of its own.
    out = tmp_path / "soak.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--base-url",
            hardened.base_url,
            "--api-key",
            API_KEY,
            "--duration",
            "20",
            "--warmup",
            "8",
            "--calibrate",
            "5",
            "--calibration-concurrency",
            "6",
            "--sample-every",
            "3",
            "--max-request-body",
            str(MAX_REQUEST_BODY),
            "--seed",
            "16",
            "--out",
            str(out),
        ],
        check=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    result = json.loads(out.read_text())
    assert result["requests"].get("disconnect", 0) > 0 and result["requests"].get("oversized", 0) > 0
    assert result["completed"] > 0
    assert result["checks"] == {
        "no_unintended_errors": True,
        "no_leaked_kv_blocks": True,
        "rss_growth_under_limit": True,
        "healthy_after": True,
    }, (result["unintended_examples"], result["rss"]["growth"], result["workers_after"])
    # The soak's own reading of /v1/status, checked against the workers themselves.
    stats = hardened.wait_idle()
    assert all(s.num_free_blocks == s.num_blocks and s.num_running == 0 for s in stats.values()), stats
    with hardened.client() as client:
        assert ask_good(client).json()["choices"][0]["message"]["content"] == good_answer
