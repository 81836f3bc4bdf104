"""Placement per pool (cluster.placement), starting or joining Ray (cluster.launcher.start_ray) and
finding the model (workers.models.files): the rules, on clusters described by hand, and Ray's own
behaviour where it matters (a stale `ray_current_cluster` is never joined).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from cluster.config import BatonConfig
from cluster.placement import (
    NodeOffer,
    PoolPlacement,
    SpawnedWorker,
    labels_match,
    lacking,
    private_ray_cpus,
    resolve_pool,
    unplaced_message,
    worker_config,
)
from common.roles import Role
from workers.models.files import ModelNotFoundError, is_repo_id, resolve_model_dir
from workers.shell.worker import WorkerConfig, _build_engine_and_kv

ROOT = Path(__file__).resolve().parents[2]
HEAD = NodeOffer("a" * 56, "10.0.0.1", {"CPU": 8.0, "memory": 1e9}, {"CPU": 8.0}, {})


def gpu_node(name: str, resource: str, free: float = 4.0, labels: dict | None = None) -> NodeOffer:
    return NodeOffer(
        name * 56,
        "10.0.0.2",
        {"CPU": 32.0, "GPU": 4.0, resource: 4.0},
        {"CPU": 32.0, "GPU": free, resource: free},
        labels or {},
    )


PREFILL, DECODE = gpu_node("b", "baton_prefill"), gpu_node("c", "baton_decode")


def test_gpu_cluster_gets_gpus_and_the_pool_resource_whatever_the_transport():
    config = BatonConfig.from_options(transport="gloo", threads_per_worker=4)
    prefill = resolve_pool(config, "prefill", [HEAD, PREFILL, DECODE])
    assert prefill == PoolPlacement("prefill", 4.0, 1.0, {"baton_prefill": 1.0}, {})
    assert prefill.device == "cuda"
    assert prefill.ray_options() == {"num_cpus": 4.0, "num_gpus": 1.0, "resources": {"baton_prefill": 1.0}}
    decode = resolve_pool(config, "decode", [HEAD, PREFILL, DECODE])
    assert decode.resources == {"baton_decode": 1.0} and decode.num_gpus == 1.0
    # The worker runs its engine (and so its KV cache) where Ray gives it a GPU.
    assert worker_config(config, "decode", "decode-0", decode).engine.device == "cuda"


def test_a_cpu_transport_on_gpu_workers_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="transport 'cpu' .* needs the workers' KV caches on the CPU"):
        resolve_pool(BatonConfig.from_options(transport="cpu"), "decode", [HEAD, DECODE])
    assert resolve_pool(BatonConfig.from_options(transport="cpu"), "decode", [HEAD]).device == "cpu"


def test_cpu_machine_asks_for_nothing_it_does_not_have():
    config = BatonConfig()
    pool = resolve_pool(config, "decode", [HEAD])
    assert pool == PoolPlacement("decode", 0.0, 0.0, {}, {})
    assert pool.ray_options() == {"num_cpus": 0.0, "num_gpus": 0.0}
    wc = worker_config(config, "decode", "decode-0", pool)
    assert wc.engine.device == "cpu" and wc.transport == "auto" and wc.model is None  # resolved on its node
    assert wc.kv_load_failure_policy == "recompute"
    failing = BatonConfig.from_options(kv_load_failure_policy="fail")
    assert worker_config(failing, "decode", "decode-0", pool).kv_load_failure_policy == "fail"


def test_cpu_workers_split_the_cores_between_them(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    config = BatonConfig()  # 1 prefill + 1 decode worker, no threads_per_worker: 2 threads each
    for role in ("prefill", "decode"):
        wc = worker_config(config, role, f"{role}-0", resolve_pool(config, role, [HEAD]))
        assert wc.engine.num_threads == 2, role
    config = BatonConfig.from_options(decode_workers=3)  # 4 workers: a thread each
    assert (
        worker_config(config, "prefill", "prefill-0", resolve_pool(config, "prefill", [HEAD])).engine.num_threads == 1
    )
    config = BatonConfig.from_options(threads_per_worker=3)
    assert worker_config(config, "decode", "decode-0", resolve_pool(config, "decode", [HEAD])).engine.num_threads == 3


def test_explicit_gpus_labels_and_resource_names():
    config = BatonConfig.from_options(
        gpus_per_worker=2.0, prefill_node_labels="pool=prefill,zone=in(a,b)", prefill_resource="fast_prefill"
    )
    pool = resolve_pool(config, "prefill", [HEAD, PREFILL])  # nobody offers fast_prefill: not asked for
    assert pool == PoolPlacement("prefill", 0.0, 2.0, {}, {"pool": "prefill", "zone": "in(a,b)"})
    assert pool.ray_options()["label_selector"] == {"pool": "prefill", "zone": "in(a,b)"}
    with pytest.raises(ValueError, match="prefill_node_labels: cannot read 'pool' as key=value"):
        BatonConfig.from_options(prefill_node_labels="pool")
    with pytest.raises(ValueError, match="placement_timeout must be > 0"):
        BatonConfig.from_options(placement_timeout=0.0)


def test_labels_match_as_ray_selects():
    labels = {"pool": "decode", "zone": "a"}
    assert labels_match({"pool": "decode"}, labels)
    assert not labels_match({"pool": "prefill"}, labels)
    assert labels_match({"pool": "!prefill", "zone": "in(a,b)"}, labels)
    assert not labels_match({"zone": "!in(a,b)"}, labels)
    assert not labels_match({"gpu": "h100"}, labels)


def test_what_is_lacking_is_named_with_what_the_nodes_offer():
    gpu = PoolPlacement("decode", 1.0, 1.0, {"baton_decode": 1.0}, {})
    assert lacking(gpu, [HEAD]) == (
        "Lacking: GPU (needs 1, the most any node offers is 0); baton_decode (needs 1, the most any node offers is 0)"
    )
    assert lacking(gpu, [HEAD, PREFILL]) == "Lacking: baton_decode (needs 1, the most any node offers is 0)"
    split = [
        NodeOffer("d" * 56, "10.0.0.3", {"GPU": 1.0}, {"GPU": 1.0}, {}),
        NodeOffer("e" * 56, "10.0.0.4", {"CPU": 1.0, "baton_decode": 1.0}, {"CPU": 1.0, "baton_decode": 1.0}, {}),
    ]
    assert lacking(gpu, split) == "Lacking: no single node offers all of CPU 1, GPU 1, baton_decode 1"
    busy = gpu_node("c", "baton_decode", free=0.0)
    assert lacking(gpu, [HEAD, busy]) == "Lacking: GPU, baton_decode is all in use on the nodes that have it"
    labelled = PoolPlacement("decode", 0.0, 0.0, {}, {"pool": "decode"})
    assert lacking(labelled, [HEAD, PREFILL]) == "Lacking: no node carries the labels pool=decode"
    waiting = [SpawnedWorker("decode-1", Role.DECODE, 1, None, gpu, "baton-decode-1")]
    message = unplaced_message(waiting, 30.0, [HEAD, busy])
    assert message.startswith(
        "the decode pool cannot be placed: decode-1 still not placed by Ray after 30 s; "
        "each needs CPU 1, GPU 1, baton_decode 1. Lacking: GPU, baton_decode is all in use"
    )
    assert (
        "The cluster's nodes offer: aaaaaaaaaaaa (10.0.0.1): CPU 8/8 free; "
        "cccccccccccc (10.0.0.2): CPU 32/32 free, GPU 0/4 free, baton_decode 0/4 free" in message
    )


def test_private_ray_makes_room_for_explicit_threads():
    assert private_ray_cpus(BatonConfig(), 2) == 2
    assert private_ray_cpus(BatonConfig.from_options(threads_per_worker=2, decode_workers=2), 2) == 6


@pytest.mark.slow
def test_a_stale_ray_current_cluster_and_RAY_ADDRESS_are_never_joined():
    """Without --address, start_ray starts a private Ray even when /tmp/ray/ray_current_cluster
    (here under RAY_TMPDIR) and RAY_ADDRESS name a cluster: as after a `ray start` elsewhere."""
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    tmp_path = Path(tempfile.mkdtemp(prefix="btst-", dir="/tmp"))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens there
    script = textwrap.dedent("""
        import ray
        from cluster.launcher import start_ray
        assert start_ray(None, num_cpus=3) is True
        print("CPUS", ray.cluster_resources()["CPU"], len(ray.nodes()))
        ray.shutdown()
    """)
    env = dict(
        os.environ,
        RAY_TMPDIR=str(tmp_path),
        RAY_ADDRESS="127.0.0.1:1",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=str(ROOT),
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
        )
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPUS 3.0 1" in proc.stdout


def test_hugging_face_repo_id_comes_from_the_local_cache_only(tmp_path, monkeypatch):
    folder = resolve_model_dir(None, quiet=True)
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = repo / "snapshots" / "feedbeef"
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        os.symlink(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("feedbeef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and not is_repo_id(str(folder))
    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot
    with pytest.raises(
        ModelNotFoundError,
        match=r"'org/missing' is neither a folder nor in the local Hugging Face "
        r"cache '.*hub'; Baton never downloads",
    ):
        resolve_model_dir("org/missing")


def test_worker_without_the_model_names_its_node_and_the_path():
    config = WorkerConfig("decode-3", "decode", "/nowhere/llama", node_id="f00d" * 14, host="10.1.2.3")
    with pytest.raises(
        ModelNotFoundError,
        match=r"worker decode-3 on node (f00d){14} \(10.1.2.3\): model path "
        r"'/nowhere/llama' does not exist",
    ):
        _build_engine_and_kv(config)
