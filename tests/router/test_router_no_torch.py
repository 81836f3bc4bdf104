"""The router must never import torch (nor transformers, which would pull it in).

Ray is allowed: the router talks to the worker pools through Ray actor handles (router.ray_backend).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib, pkgutil, sys
import router
names = ["router"] + [m.name for m in pkgutil.walk_packages(router.__path__, "router.")]
for name in names:
    importlib.import_module(name)
# build an app and a tokenizer too: lazy imports on these paths count as well
from router.app import build_app
from testkit.backend import FakeBackend
from router.tokenizer import Tokenizer
from workers.models.files import resolve_model_dir
tok = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
build_app(FakeBackend(tok), tok, "m", 8192)
heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
print("MODULES", len(names), ",".join(names))
print("HEAVY", ",".join(heavy))
"""


def test_router_modules_do_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    modules = lines["MODULES"].split(" ", 1)[1].split(",")
    for expected in (
        "router.app",
        "router.backend",
        "router.errors",
        "router.formatting",
        "router.protocol",
        "router.routes",
        "router.routing",
        "router.serving",
        "router.streaming",
        "router.tokenizer",
        "router.ray_backend",
    ):
        assert expected in modules
    assert lines.get("HEAVY", "") == "", f"router imported {lines.get('HEAVY')}"
