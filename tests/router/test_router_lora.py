"""The router's side of LoRA: requests name adapters as their `model` (404 otherwise, as vLLM),
/v1/models lists them with `parent` and `root`, every router process lists what the workers
report serving (so a run-time load through one router reaches the others), routing ranks workers
by where the adapter is resident and never sends a request to a worker without its adapter, and
/metrics carries vLLM's `lora_requests_info`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from fastapi.testclient import TestClient

from common.lora import LoRAModuleSpec, LoRAStatus
from common.request import RequestContext
from router.app import build_app
from router.backend import WorkerInfo
from router.config import ServerConfig
from router.prefix_index import PrefixIndex
from router.routing import KvAwarePolicy, RoundRobinPolicy, RoutingConfig
from testkit.backend import FakeBackend
from tests.router.conftest import MAX_MODEL_LEN, MODEL_NAME

SQL = LoRAModuleSpec("sql", "/adapters/sql")
CHAT = LoRAModuleSpec("chat", "/adapters/chat", "another-base")


@dataclass
class Workers:
    """What the workers serve, shared by every router process's backend."""

    served: list[LoRAModuleSpec] = field(default_factory=list)
    resident: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refuse: set[str] = field(default_factory=set)


@dataclass
class LoRAFakeBackend(FakeBackend):
    pool: Workers = field(default_factory=Workers)

    def workers(self) -> list[WorkerInfo]:
        return [
            replace(
                w,
                lora=LoRAStatus(
                    resident=self.pool.resident.get(w.worker_id, ()), max_loras=2, served=tuple(self.pool.served)
                ),
            )
            for w in super().workers()
        ]

    async def load_lora_adapter(self, spec: LoRAModuleSpec) -> None:
        if spec.name in self.pool.refuse:
            raise ValueError(f"LoRA adapter {spec.name!r} ({spec.path}): rank 64 is over --max-lora-rank 16")
        self.pool.served.append(spec)

    async def unload_lora_adapter(self, name: str) -> None:
        self.pool.served = [s for s in self.pool.served if s.name != name]


def app(tokenizer, pool: Workers, runtime: bool, monkeypatch) -> TestClient:
    if runtime:
        monkeypatch.setenv("BATON_ALLOW_RUNTIME_LORA_UPDATING", "1")
    else:
        monkeypatch.delenv("BATON_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    server = ServerConfig(enable_lora=True, lora_adapters=(SQL,))
    backend = LoRAFakeBackend(tokenizer, pool=pool)
    return TestClient(build_app(backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=server))


def completion(client: TestClient, model: str):
    return client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})


def test_models_lists_adapters_and_unknown_models_are_404(tokenizer, monkeypatch):
    pool = Workers(served=[SQL, CHAT])
    client = app(tokenizer, pool, False, monkeypatch)
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == "/adapters/sql"
    assert cards["chat"]["parent"] == "another-base" and cards[MODEL_NAME]["parent"] is None
    assert completion(client, "sql").status_code == 200
    r = completion(client, "nope")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert (
        error["message"]
        == "The model `nope` does not exist. This server serves `SmolLM2-135M-Instruct`, `sql`, `chat`."
    )
    # Without BATON_ALLOW_RUNTIME_LORA_UPDATING the endpoints do not exist, as in vLLM.
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_a_load_through_one_router_is_served_by_every_router(tokenizer, monkeypatch):
    pool = Workers(served=[SQL])
    first, second = app(tokenizer, pool, True, monkeypatch), app(tokenizer, pool, True, monkeypatch)
    assert completion(second, "chat").status_code == 404
    r = first.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    assert completion(second, "chat").status_code == 200
    assert second.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert completion(first, "chat").status_code == 404
    pool.refuse.add("big")
    r = first.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "/adapters/big"})
    assert r.status_code == 400 and "rank 64 is over --max-lora-rank 16" in r.json()["error"]["message"]
    assert first.get("/health").status_code == 200


def test_before_any_worker_reports_the_configured_adapters_are_served(tokenizer):
    class Silent(LoRAFakeBackend):
        def workers(self) -> list[WorkerInfo]:
            return FakeBackend.workers(self)  # no stats yet: max_loras 0

    backend = Silent(tokenizer)
    client = TestClient(
        build_app(
            backend, tokenizer, MODEL_NAME, MAX_MODEL_LEN, server=ServerConfig(enable_lora=True, lora_adapters=(SQL,))
        )
    )
    assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {MODEL_NAME, "sql"}
    assert completion(client, "sql").status_code == 200


def worker(wid: str, role: str, **lora) -> WorkerInfo:
    return WorkerInfo(wid, role, lora=LoRAStatus(max_loras=2, served=(SQL, CHAT), **lora))


@pytest.mark.parametrize(
    ("other", "winner"),
    [
        (dict(resident=("sql",)), "decode-1"),  # running there beats resident elsewhere
        (dict(resident=("chat", "x")), "decode-1"),  # running beats must-evict
    ],
)
def test_routing_prefers_where_the_adapter_runs(other, winner):
    policy = KvAwarePolicy(PrefixIndex(), 16, RoutingConfig(temperature=0, local_prefill_threshold=0))
    workers = [
        worker("prefill-0", "prefill"),
        worker("decode-0", "decode", **other),
        worker("decode-1", "decode", resident=("sql",), running=("sql",)),
    ]
    assert policy.choose(list(range(40)), workers, RequestContext("r", adapter="sql")).decode_worker == winner
    # Ranked by llm-d's order: running 0 < resident .25 < free slot .5 < evict 1.
    status = LoRAStatus(resident=("a", "b"), running=("a",), max_loras=3)
    assert [status.affinity(n) for n in ("a", "b", "c", None)] == [0.0, 0.25, 0.5, 0.0]
    assert replace(status, max_loras=2).affinity("c") == 1.0


def test_no_policy_sends_a_request_to_a_worker_without_its_adapter():
    lacking = WorkerInfo("decode-0", "decode", lora=LoRAStatus(max_loras=2, served=(CHAT,)))
    serving = worker("decode-1", "decode")
    prefill = [
        WorkerInfo("prefill-0", "prefill", lora=LoRAStatus(max_loras=2, served=(CHAT,))),
        worker("prefill-1", "prefill"),
    ]
    context = RequestContext("r", adapter="sql")
    kv = KvAwarePolicy(PrefixIndex(), 16, RoutingConfig(temperature=0, local_prefill_threshold=0))
    rr = RoundRobinPolicy()
    for _ in range(3):
        for policy in (kv, rr):
            route = policy.choose(list(range(40)), [lacking, serving, *prefill], context)
            assert (route.decode_worker, route.prefill_worker) == ("decode-1", "prefill-1")


def test_metrics_carry_lora_requests_info(tokenizer, monkeypatch):
    pool = Workers(served=[SQL], resident={"decode-0": ("sql",)})
    client = app(tokenizer, pool, False, monkeypatch)
    assert completion(client, "sql").status_code == 200
    text = client.get("/metrics").text
    assert 'baton:lora_requests_info{max_lora="2",model_name="SmolLM2-135M-Instruct",role="decode"' in text
    assert 'baton:lora_requests_total{lora_name="sql",model_name="SmolLM2-135M-Instruct"} 1.0' in text
    status = client.get("/v1/status").json()
    decode = status["pools"]["decode"][0]
    assert decode["lora_resident"] == ["sql"] and decode["max_loras"] == 2
    (trace,) = status["recent"]
    # The default policy's route: FakeBackend's workers, the adapter resident on decode-0 only.
    assert trace["lora_adapter"] == "sql"
    assert trace["lora_placement"] == "prefill-0:load decode-0:resident"
