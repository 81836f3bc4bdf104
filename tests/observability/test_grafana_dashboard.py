"""The Grafana dashboard only queries metrics the router really exports (no silent drift)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from router.app import build_app
from router.backend import FakeBackend

ROOT = Path(__file__).resolve().parents[2]


def test_every_dashboard_metric_is_exported():
    from router.tokenizer import Tokenizer
    from workers.model_files import resolve_model_dir

    try:
        tok = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    except Exception as e:  # pragma: no cover
        pytest.skip(f"default model not available: {e}")
    dash = json.loads((ROOT / "helm" / "dashboards" / "baton-grafana.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"baton:[a-z_]+", e)}
    assert len(used) >= 15
    from router.prefix_index import PrefixIndex

    backend = FakeBackend(tok)
    backend.prefix_index = PrefixIndex()  # as RayBackend has: enables baton:prefix_index_blocks
    client = TestClient(build_app(backend, tok, "m", 8192))
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    exported = set(re.findall(r"^(baton:[a-z_]+)", client.get("/metrics").text, re.MULTILINE))
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
