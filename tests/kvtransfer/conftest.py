"""Fixtures for the kvtransfer contract suite: a prefill side P and a decode side D, either two
objects in this process (inprocess) or two Ray actors (cross-process backends)."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from common import transports
from testkit.kvtransfer import KVWorker

REPO = pathlib.Path(__file__).resolve().parents[2]
# Every single backend (the pairwise transport is tested over them in test_pairwise*).
BACKENDS = tuple(b for b in transports.BACKENDS if b != "pairwise")
CROSS_PROCESS = set(transports.FIXED_CHOICES)


class RaySide:
    """Calls a KVWorker actor synchronously, with a bound so a broken backend fails the test
    instead of hanging it."""

    def __init__(self, actor) -> None:
        self._actor = actor

    def __getattr__(self, name):
        import ray

        method = getattr(self._actor, name)
        return lambda *args: ray.get(method.remote(*args), timeout=60)


HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """A test of a cross-process backend (its `kind` or `kind_` parameter) runs on `ray_sides`,
    which starts Ray: it is `slow` (tests/conftest.py marks those that ask for `ray_sides` itself)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if HERE in pathlib.Path(item.path).parents and CROSS_PROCESS.intersection(
            str(params.get(name)) for name in ("kind", "kind_")
        ):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def ray_sides():
    """Two KVWorker actors on a private Ray of this module's own (testkit.cluster.private_ray:
    whatever Ray an earlier suite left connected in this process is ended first, and this one is
    shut down after the module)."""
    import ray

    from testkit.cluster import private_ray

    with private_ray(
        num_cpus=2,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
    ):
        worker = ray.remote(num_cpus=0)(KVWorker)
        p, d = worker.remote(), worker.remote()
        sides = RaySide(p), RaySide(d)
        assert sides[0].pid() != sides[1].pid() != os.getpid()
        yield sides
        for side in sides:
            side.close()
        for actor in (p, d):
            ray.kill(actor)


@pytest.fixture(params=BACKENDS)
def kind(request) -> str:
    if request.param == "nccl" and not torch.cuda.is_available():
        pytest.skip("nccl backend needs CUDA")
    return request.param


@pytest.fixture
def sides(kind, request):
    """(P, D) for this backend: P sends, D receives."""
    if kind in CROSS_PROCESS:
        pair = request.getfixturevalue("ray_sides")
    else:
        pair = KVWorker(), KVWorker()
    yield pair
    for side in pair:
        side.close()


@pytest.fixture
def sides_for(request):
    """Like `sides`, for tests that pick their backend themselves."""
    made = []

    def make(kind: str):
        pair = request.getfixturevalue("ray_sides") if kind in CROSS_PROCESS else (KVWorker(), KVWorker())
        made.append(pair)
        return pair

    yield make
    for pair in made:
        for side in pair:
            side.close()
