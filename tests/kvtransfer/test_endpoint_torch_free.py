"""KVLayout and KVEndpoint are torch-free (common.protocol): a decode worker's real endpoint
crosses the router, which must never import torch, as a typed object, not as pickled bytes."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch

from common.protocol import KV_DTYPE_ITEMSIZE
from kvtransfer import KVEndpoint, KVLayout, create_transport, torch_dtype
from kvtransfer.base import TORCH_DTYPES

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float8_e4m3fn", kv_scales=((0.5, 0.25), (2.0, 1.5))
)

# Runs in a fresh interpreter: unpickles the endpoints the way Ray hands them to the router,
# caches one through RayBackend, wraps it in a PrefillRequest, and checks torch never loaded.
SCRIPT = r"""
import asyncio, pickle, sys
from common.protocol import KVEndpoint, KVLayout
from common.request import PrefillRequest, RequestContext, WorkerRequest
from common.sampling_params import SamplingParams
from router.pools import WorkerPools

endpoints = pickle.loads(open(sys.argv[1], "rb").read())
for ep in endpoints:
    assert type(ep) is KVEndpoint and type(ep.layout) is KVLayout, type(ep)
    assert ep.layout.block_bytes == 2 * 2 * 4 * 2 * 8 * 1
    hash(ep.peer_key)

class Method:
    def __init__(self):
        self.calls = 0
    def remote(self):
        self.calls += 1
        async def get():
            return endpoints[0]
        return get()

class Handle:
    endpoint = Method()

pools = WorkerPools([])
pools.add_worker("d0", "decode", Handle())
w = pools.get("d0")
got = asyncio.run(pools.endpoint(w))
again = asyncio.run(pools.endpoint(w))
assert got is again is endpoints[0] and Handle.endpoint.calls == 1
request = PrefillRequest(WorkerRequest(RequestContext("r"), [1, 2, 3], SamplingParams()), got, [4], 0)
assert pickle.loads(pickle.dumps(request)).peer_endpoint == got
heavy = sorted(m for m in ("torch", "transformers", "triton") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


def test_real_endpoints_cross_the_router_without_torch(tmp_path):
    transports = [create_transport(kind) for kind in ("shm", "gloo")]
    try:
        endpoints = []
        for t in transports:
            t.allocate_cache(LAYOUT, 4)
            endpoints.append(t.endpoint())
        assert all(type(ep) is KVEndpoint and ep.__module__ == "common.protocol" for ep in endpoints)
        blob = tmp_path / "endpoints.pkl"
        blob.write_bytes(pickle.dumps(endpoints))
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(blob)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    finally:
        for t in transports:
            t.close()
    assert proc.returncode == 0, proc.stderr
    heavy = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY")]
    assert heavy == ["HEAVY "], f"router side imported {heavy}"


def test_protocol_module_does_not_import_torch():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, common.protocol; print('torch' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_dtype_names_match_torch():
    assert TORCH_DTYPES.keys() == KV_DTYPE_ITEMSIZE.keys()
    for name, size in KV_DTYPE_ITEMSIZE.items():
        layout = KVLayout(1, 1, 1, 1, name)
        assert torch_dtype(layout).itemsize == size == layout.element_size
        assert torch.empty(0, dtype=torch_dtype(layout)).element_size() == size


def test_endpoint_identity_ignores_the_address():
    a = KVEndpoint("shm", "w1", LAYOUT, 4, {"segment": "x"})
    b = KVEndpoint("shm", "w1", LAYOUT, 4, {"segment": "y"})
    assert a == b and hash(a) == hash(b) and a.peer_key == ("shm", "w1")
