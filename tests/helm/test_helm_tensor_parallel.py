"""Tensor parallelism in the chart: a worker of TP size N is N ranks in one pod, so each pool's pods
request the pool's `gpus` (per rank) times its TP size, in the container's resources and in Ray's
num-gpus, and give Ray CPUs for every rank's threads."""

from __future__ import annotations

from pathlib import Path

import helm_python
import pytest

from cluster.config import BatonConfig
from tests.helm.helmlib import CHART, objects, only, render, variant_objects, worker_group

GPU = "nvidia.com/gpu"


def placement(**keys) -> dict:
    return {"baton": {"placement": keys}}


def pods(objs) -> dict[str, tuple[dict, dict]]:
    """role -> (the worker container's resources, the group's rayStartParams)."""
    cluster = only(objs, "RayCluster")
    out = {}
    for role in ("prefill", "decode"):
        group = worker_group(cluster, role)
        out[role] = (group["template"]["spec"]["containers"][0].get("resources", {}), group["rayStartParams"])
    return out


def pod_gpus(objs) -> dict[str, int]:
    """role -> GPUs a pod asks for; checks requests, limits and num-gpus agree."""
    out = {}
    for role, (resources, params) in pods(objs).items():
        requested = resources.get("requests", {}).get(GPU, 0)
        assert resources.get("limits", {}).get(GPU, 0) == requested, role
        assert params["num-gpus"] == str(requested), role
        out[role] = requested
    return out


def baton_config(objs, tmp_path: Path) -> BatonConfig:
    path = tmp_path / "config.yaml"
    path.write_text(only(objs, "ConfigMap", "baton-config")["data"]["config.yaml"])
    return BatonConfig.load(path)


def test_default_pods_request_one_gpu_each(tmp_path):
    objs = variant_objects(None)
    assert pod_gpus(objs) == {"prefill": 1, "decode": 1}
    config = baton_config(objs, tmp_path).placement
    assert (config.tensor_parallel_size, config.tp_size("prefill"), config.tp_size("decode")) == (1, 1, 1)
    assert config.prefill_tensor_parallel_size is None and config.decode_tensor_parallel_size is None


def test_tensor_parallel_size_multiplies_both_pools(tmp_path):
    objs = objects(render(placement(tensor_parallel_size=2, threads_per_worker=2)))
    assert pod_gpus(objs) == {"prefill": 2, "decode": 2}
    for role, (_, params) in pods(objs).items():
        assert params["num-gpus"] == "2", role
    # Baton sees the TP size as given and GPUs per rank: each rank asks Ray for one GPU.
    config = baton_config(objs, tmp_path).placement
    assert config.gpus_per_worker == 1
    assert (config.tp_size("prefill"), config.tp_size("decode")) == (2, 2)


def test_each_pool_takes_its_own_size(tmp_path):
    values = placement(prefill_tensor_parallel_size=4, decode_tensor_parallel_size=1, threads_per_worker=1)
    values |= {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}
    objs = objects(render(values))
    assert pod_gpus(objs) == {"prefill": 4, "decode": 1}
    config = baton_config(objs, tmp_path).placement  # the handoff re-slices KV heads between the sizes
    assert (config.tp_size("prefill"), config.tp_size("decode")) == (4, 1)
    # Sizes that do not nest are refused by Baton's loader, naming both.
    values = placement(prefill_tensor_parallel_size=2, decode_tensor_parallel_size=3, threads_per_worker=1)
    with pytest.raises(ValueError, match="prefill_tensor_parallel_size 2 and decode_tensor_parallel_size 3: one must"):
        baton_config(objects(render(values)), tmp_path)
    # A pool's own size wins over tensor_parallel_size, which covers the other pool.
    objs = objects(render(placement(tensor_parallel_size=2, decode_tensor_parallel_size=1, threads_per_worker=2)))
    assert pod_gpus(objs) == {"prefill": 2, "decode": 1}
    # Two GPUs per rank, TP 2: four per pod.
    values = placement(tensor_parallel_size=2, threads_per_worker=2) | {"prefill": {"gpus": 2}, "decode": {"gpus": 2}}
    assert pod_gpus(objects(render(values))) == {"prefill": 4, "decode": 4}


def test_the_accelerator_resource_name_follows_tp():
    values = placement(tensor_parallel_size=2, threads_per_worker=2) | {"accelerator": {"resourceName": "amd.com/gpu"}}
    for role, (resources, params) in pods(objects(render(values))).items():
        assert resources["requests"]["amd.com/gpu"] == resources["limits"]["amd.com/gpu"] == 2, role
        assert GPU not in resources["limits"] and params["num-gpus"] == "2"


def test_cpu_pools_request_no_gpus_whatever_the_tp_size(tmp_path):
    values = placement(tensor_parallel_size=2, threads_per_worker=2) | {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}
    objs = objects(render(values))
    for role, (resources, params) in pods(objs).items():
        for kind in ("requests", "limits"):
            assert not any(k.endswith("/gpu") for k in resources[kind]), (role, kind)
        assert params["num-gpus"] == "0", role
    assert baton_config(objs, tmp_path).placement.gpus_per_worker == 0


def test_a_pod_must_give_ray_cpus_for_every_rank():
    """Each rank asks Ray for threads_per_worker CPUs and all of a worker's ranks share its pod:
    the chart refuses pods too small for them, which Ray could never place a worker on."""
    with pytest.raises(
        helm_python.HelmError,
        match=r"a prefill worker is 2 rank\(s\) of baton.placement.threads_per_worker \(4\) CPUs "
        r"each, 8 CPUs, but a prefill pod gives Ray 4",
    ):
        render(placement(tensor_parallel_size=2))  # the default pods: 4 threads on 4 CPUs
    with pytest.raises(helm_python.HelmError, match=r"a decode worker is 4 rank\(s\).*decode pod gives Ray 4"):
        render(placement(decode_tensor_parallel_size=4, threads_per_worker=2))
    eight = {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"cpu": "8", "memory": "32Gi"}}
    objs = objects(
        render(placement(tensor_parallel_size=2) | {"prefill": {"resources": eight}, "decode": {"resources": eight}})
    )
    assert pod_gpus(objs) == {"prefill": 2, "decode": 2}
    # What Ray gets, as KubeRay derives it: rayStartParams num-cpus, else the CPU limit (rounded up),
    # else the CPU request.
    fits = [
        {"rayStartParams": {"num-cpus": "8"}},
        {"resources": {"limits": {"cpu": "7500m"}}},
        {"resources": {"limits": None, "requests": {"cpu": 8}}},
    ]
    for pool in fits:
        objects(render(placement(tensor_parallel_size=2) | {"prefill": pool, "decode": pool}))
    with pytest.raises(helm_python.HelmError, match=r"prefill pod gives Ray 7"):
        render(placement(tensor_parallel_size=2) | {"prefill": {"resources": {"limits": {"cpu": "6500m"}}}})
    # Unknown CPUs (no limit nor request) or no threads_per_worker (Ray reserves no CPUs): nothing to check.
    objects(render(placement(tensor_parallel_size=2) | {"prefill": {"resources": None}, "decode": {"resources": None}}))
    objects(render(placement(tensor_parallel_size=2, threads_per_worker=None)))
    # An empty prefill pool is not checked.
    objects(
        render(
            placement(prefill_tensor_parallel_size=8, threads_per_worker=2)
            | {"prefill": {"replicas": 0, "minReplicas": 0, "maxReplicas": 0}}
        )
    )


@pytest.mark.parametrize("key", ["tensor_parallel_size", "prefill_tensor_parallel_size", "decode_tensor_parallel_size"])
def test_a_tp_size_below_one_is_refused(key):
    with pytest.raises(
        helm_python.HelmError, match=rf"baton.placement.{key} is 0: a tensor-parallel size is at least 1"
    ):
        render(placement(**{key: 0}))


def test_the_tp_keys_reach_baton_unchanged(tmp_path):
    values = placement(
        tensor_parallel_size=2, prefill_tensor_parallel_size=4, decode_tensor_parallel_size=4, threads_per_worker=1
    )
    config = baton_config(objects(render(values)), tmp_path).placement
    assert (config.tensor_parallel_size, config.prefill_tensor_parallel_size, config.decode_tensor_parallel_size) == (
        2,
        4,
        4,
    )
    # A null per-pool size falls back to tensor_parallel_size, in the chart as in Baton.
    objs = objects(render(placement(tensor_parallel_size=2, decode_tensor_parallel_size=None, threads_per_worker=2)))
    assert pod_gpus(objs) == {"prefill": 2, "decode": 2}
    assert baton_config(objs, tmp_path).placement.tp_size("decode") == 2


def test_the_schema_takes_the_tp_keys():
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(
            placement(tensor_parallel_size=2, prefill_tensor_parallel_size=4, decode_tensor_parallel_size=None)
        )
    with pytest.raises(helm_python.HelmValuesError, match="/baton/placement/tensor_parallel_size"):
        render(placement(tensor_parallel_size="2"))
