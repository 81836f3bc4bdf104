"""What the chart hands Baton: a configuration file Baton's own loader accepts, a head command
`baton serve` accepts, and worker groups whose Ray resources match the configuration's placement."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import helm_python
import pytest
import yaml

from cluster.cli import _parser
from cluster.config import BatonConfig
from tests.helm.helmlib import (
    CHART,
    VARIANT_IDS,
    VARIANTS,
    crd_errors,
    load_values,
    objects,
    only,
    render,
    variant_objects,
    worker_group,
)

CONFIG_FILE = "/etc/baton/config.yaml"


def baton_config(objs, tmp_path: Path) -> BatonConfig:
    """The rendered ConfigMap's file, read by Baton's loader (which refuses unknown keys)."""
    config_map = only(objs, "ConfigMap", "baton-config")
    assert set(config_map["data"]) == {"config.yaml"}
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    return BatonConfig.load(path)


def head_container(objs) -> dict:
    (container,) = only(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def baton_serve_argv(container: dict) -> list[str]:
    """The `baton serve ...` words of the head's shell command."""
    assert container["command"] == ["/bin/bash", "-c", "--"]
    (script,) = container["args"]
    commands = [c.strip() for part in script.split("&&") for c in part.split(";")]
    (serve,) = [c for c in commands if "baton serve" in c]
    words = shlex.split(serve)
    return words[words.index("baton") + 1 :]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_configmap_is_accepted_by_batons_loader(variant, tmp_path):
    objs = variant_objects(variant)
    config = baton_config(objs, tmp_path)
    cluster = only(objs, "RayCluster")
    prefill, decode = worker_group(cluster, "prefill"), worker_group(cluster, "decode")
    placement = config.placement
    assert placement.address == "auto"
    assert (placement.prefill_workers, placement.decode_workers) == (prefill["replicas"], decode["replicas"])
    assert (config.server.host, config.server.port) == ("0.0.0.0", only(objs, "Service")["spec"]["ports"][0]["port"])
    for role, group in (("prefill", prefill), ("decode", decode)):
        # gpus_per_worker is per rank; a pod holds one worker, all its ranks.
        pod_gpus = placement.gpus_per_worker * placement.tp_size(role)
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert pod_gpus == limits.get("nvidia.com/gpu", 0), role
        assert float(group["rayStartParams"]["num-gpus"]) == pod_gpus


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_the_baton_values_reach_baton_unchanged(variant, tmp_path):
    """The chart's `baton` values are Baton's config file: whatever they set, Baton sees."""
    values = load_values(variant) or {}
    with helm_python.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)["baton"]
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(merged))
    expected = BatonConfig.load(given).to_dict()
    rendered = baton_config(variant_objects(variant), tmp_path).to_dict()
    derived = {
        ("server", "host"),
        ("server", "port"),
        ("placement", "address"),
        ("placement", "prefill_workers"),
        ("placement", "decode_workers"),
        ("placement", "gpus_per_worker"),
    }
    if (values.get("lora") or {}).get("adapters"):  # the `lora` values, written into the engine section
        derived |= {
            ("engine", k) for k in ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")
        }
    for section, options in expected.items():
        if not isinstance(options, dict):
            assert rendered[section] == options, section
            continue
        for key, value in options.items():
            if (section, key) not in derived:
                assert rendered[section][key] == value, f"{section}.{key}"
    if variant is not None and "gpu-values" in variant.name:
        assert rendered["engine"]["quantization"] == rendered["engine"]["kv_cache_dtype"] == "fp8"
        assert rendered["model"] == "/models/Meta-Llama-3.1-8B-Instruct"


def test_keys_the_chart_decides_cannot_disagree():
    with pytest.raises(helm_python.HelmError, match=r"baton.placement.prefill_workers is 5.*prefill.replicas"):
        render({"baton": {"placement": {"prefill_workers": 5}}})
    with pytest.raises(helm_python.HelmError, match=r"baton.server.port is 9000.*service.port"):
        render({"baton": {"server": {"port": 9000}}})
    with pytest.raises(helm_python.HelmError, match=r"baton.placement.address is 10.0.0.1:6379"):
        render({"baton": {"placement": {"address": "10.0.0.1:6379"}}})
    with pytest.raises(helm_python.HelmError, match=r"prefill.gpus \(2\) and decode.gpus \(1\) differ"):
        render({"prefill": {"gpus": 2}})
    # The same values are fine.
    objects(render({"baton": {"placement": {"prefill_workers": 1, "address": "auto"}, "server": {"port": 8000}}}))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_worker_groups_carry_the_pools_ray_resources(variant, tmp_path):
    objs = variant_objects(variant)
    placement = baton_config(objs, tmp_path).placement
    cluster = only(objs, "RayCluster")
    for role, resource in (("prefill", placement.prefill_resource), ("decode", placement.decode_resource)):
        params = worker_group(cluster, role)["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values())  # KubeRay's map[string]string
        # KubeRay pastes the value into `ray start --resources=...` in a shell: it must be one word
        # that the shell turns into JSON.
        (word,) = shlex.split(params["resources"])
        assert json.loads(word) == {resource: 1}
    head_params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head_params and head_params["num-cpus"] == "0"


def test_a_null_pool_resource_is_left_out_of_ray_and_said_to_baton(tmp_path):
    objs = objects(render({"baton": {"placement": {"prefill_resource": None}}}))
    placement = baton_config(objs, tmp_path).placement
    assert placement.prefill_resource is None and placement.decode_resource == "baton_decode"
    cluster = only(objs, "RayCluster")
    assert "resources" not in worker_group(cluster, "prefill")["rayStartParams"]
    assert "baton_decode" in worker_group(cluster, "decode")["rayStartParams"]["resources"]
    renamed = only(objects(render({"baton": {"placement": {"decode_resource": "h100_decode"}}})), "RayCluster")
    (word,) = shlex.split(worker_group(renamed, "decode")["rayStartParams"]["resources"])
    assert json.loads(word) == {"h100_decode": 1}


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_head_command_uses_only_flags_baton_serve_accepts(variant):
    objs = variant_objects(variant)
    container = head_container(objs)
    argv = baton_serve_argv(container)
    args = _parser().parse_args(argv)  # exits (SystemExit) on a flag `baton serve` does not have
    assert args.command == "serve" and args.address == "auto" and args.config == CONFIG_FILE
    # The file it reads is the ConfigMap's, mounted where the flag says.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in only(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert os.path.join(mounts["config"], "config.yaml") == CONFIG_FILE
    assert volumes["config"]["configMap"]["name"] == only(objs, "ConfigMap", "baton-config")["metadata"]["name"]


def test_the_flag_check_can_fail():
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--adress", "auto"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_head_starts_ray_without_blocking_then_execs_the_router(tmp_path):
    """Run the head's command in bash with stand-ins for `ray` and `baton` and KubeRay's
    generated start command (its --block would keep the router from ever starting)."""
    container = head_container(variant_objects(None))
    head = only(variant_objects(None), "RayCluster")["spec"]["headGroupSpec"]
    annotations = head["template"]["metadata"]["annotations"]
    # Without this KubeRay runs the container's command *before* its own `ray start`.
    assert annotations["ray.io/overwrite-container-cmd"] == "true"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ray", "baton"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/bash\nfor a in "$@"; do echo "$a"; done > {tmp_path}/{tool}.args\n')
        script.chmod(0o755)
    generated = (
        "ray start --head  --block  --dashboard-agent-listen-port=52365  --dashboard-host=0.0.0.0 "
        " --metrics-export-port=8080  --num-cpus=0  --resources='{\"x\":1}' "
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "KUBERAY_GEN_RAY_START_CMD": generated}
    result = subprocess.run(
        container["command"] + container["args"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    ray_args = (tmp_path / "ray.args").read_text().split("\n")[:-1]
    assert ray_args[:2] == ["start", "--head"] and "--block" not in ray_args
    assert '--resources={"x":1}' in ray_args  # the inner shell unquoted KubeRay's quoting
    baton_args = (tmp_path / "baton.args").read_text().split("\n")[:-1]
    assert baton_args == ["serve", "--address", "auto", "--config", CONFIG_FILE]


def test_model_sources_mount_the_model_in_every_ray_pod():
    def pods(values):
        cluster = only(objects(render(values)), "RayCluster")
        groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
        return [g["template"] for g in groups]

    pvc = {
        "modelSource": {"type": "pvc", "mountPath": "/models", "pvc": {"claimName": "llama", "subPath": "hf"}},
        "baton": {"model": "/models/llama"},
    }
    init = {
        "modelSource": {
            "type": "emptyDir",
            "mountPath": "/models",
            "initContainers": [{"name": "fetch", "image": "busybox:1.37", "command": ["true"]}],
        }
    }
    host = {"modelSource": {"type": "hostPath", "hostPath": {"path": "/mnt/models"}}}
    for values, volume in (
        (pvc, {"persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}),
        (init, {"emptyDir": {"sizeLimit": "64Gi"}}),
        (host, {"hostPath": {"path": "/mnt/models", "type": "Directory"}}),
    ):
        for pod in pods(values):
            spec = pod["spec"]
            assert {"name": "model", **volume} in spec["volumes"]
            mount = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
            assert mount and mount[0]["mountPath"] == "/models"
            if values is init:
                assert spec["initContainers"][0]["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
            else:
                assert "initContainers" not in spec
    assert pods(pvc)[1]["spec"]["containers"][0]["volumeMounts"][-1] == {
        "name": "model",
        "mountPath": "/models",
        "subPath": "hf",
        "readOnly": True,
    }
    for pod in pods({}):  # in the image: nothing to mount
        assert all(v["name"] != "model" for v in pod["spec"]["volumes"])
    with pytest.raises(helm_python.HelmError, match="modelSource.pvc.claimName is required"):
        render({"modelSource": {"type": "pvc"}})


def test_accelerator_resource_name_is_configurable():
    cluster = only(objects(render({"accelerator": {"resourceName": "amd.com/gpu"}})), "RayCluster")
    for role in ("prefill", "decode"):
        resources = worker_group(cluster, role)["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["amd.com/gpu"] == resources["limits"]["amd.com/gpu"] == 1
        assert "nvidia.com/gpu" not in resources["limits"]
    cpu = only(variant_objects(CHART / "ci" / "cpu-values.yaml"), "RayCluster")
    for role in ("prefill", "decode"):
        limits = worker_group(cpu, role)["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert not any(k.endswith("/gpu") for k in limits)


def test_a_cluster_without_a_prefill_pool(tmp_path):
    """prefill.replicas 0: the decode workers prefill themselves (Baton's prefill_workers 0)."""
    values = {
        "prefill": {"replicas": 0, "minReplicas": 0, "maxReplicas": 0, "gpus": 0},
        "head": {"rayStartParams": None},
    }  # null drops the chart's default (num-cpus 0)
    objs = objects(render(values))
    assert baton_config(objs, tmp_path).placement.prefill_workers == 0
    cluster = only(objs, "RayCluster")
    assert worker_group(cluster, "prefill")["replicas"] == 0
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"] == {}
    assert crd_errors(cluster) == []
