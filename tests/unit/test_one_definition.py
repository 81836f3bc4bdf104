"""Pieces that bench/, tests/ and the product once repeated exist once: a free port, the server
start-up and its health poll, the router served in a thread, the percentile, the transport names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("router", "workers", "kvtransfer", "kernels", "cluster", "common", "testkit", "bench", "tests")


def sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for folder in FOLDERS for p in (REPO / folder).rglob("*.py")}


@pytest.mark.parametrize(
    "pattern,home",
    [
        (r"^\s*def free_port\(", "common/net.py"),
        (r"^\s*def percentile\(", "common/stats.py"),
        (r"^\s*def healthy\(", "testkit/harness.py"),  # polling /health
        (r"^\s*def baton_serve\(", "testkit/harness.py"),  # `baton serve` in a subprocess until healthy
        (r"^\s*def serve_app\(", "testkit/harness.py"),  # an app in a uvicorn thread
        (r"uvicorn\.Server\(", "router/app.py"),
        (r"^\s*def leave_ray\(", "testkit/cluster.py"),
    ],
)
def test_defined_once(pattern, home):
    found = sorted(path for path, text in sources().items() if re.search(pattern, text, re.M))
    assert found == [home], f"{pattern!r} in {found}"


def test_transport_names_are_declared_once():
    # A tuple literal of two or more backend names, outside common/transports.py.
    literal = re.compile(r"\(\s*\"(?:inprocess|shm|gloo|nccl|auto|cpu)\"\s*,\s*\"(?:inprocess|shm|gloo|nccl|cpu)\"")
    found = sorted(
        path
        for path, text in sources().items()
        if literal.search(text) and path != "common/transports.py" and not path.startswith("tests/")
    )
    assert found == [], found  # offered_kinds' CPU answer, ("shm", "gloo"), lives in common/transports.py


def test_ray_loopback_is_set_in_one_place_of_the_product():
    setters = sorted(
        path
        for path, text in sources().items()
        if re.search(r"environ.*RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", text) and not path.startswith("tests/")
    )
    assert setters == [], setters  # common.envs.ensure_private_ray_env declares and sets it
