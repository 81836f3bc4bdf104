"""The Grafana dashboard only queries metrics the router really exports (no silent drift)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from router.app import build_app
from testkit.backend import FakeBackend

ROOT = Path(__file__).resolve().parents[2]


def test_every_dashboard_metric_is_exported(tokenizer):
    dash = json.loads((ROOT / "helm" / "baton" / "dashboards" / "baton-grafana.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"baton:[a-z_]+", e)}
    assert len(used) >= 15
    backend = FakeBackend(tokenizer)  # has a prefix_index, as RayBackend does: enables baton:prefix_index_blocks
    client = TestClient(build_app(backend, tokenizer, "m", 8192))
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    exported = set(re.findall(r"^(baton:[a-z_]+)", client.get("/metrics").text, re.MULTILINE))
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
