"""LoRA adapters in the chart (`lora` values): Baton's engine keys in the ConfigMap (read back by
Baton's own loader, which parses the adapters as `--lora-modules` does), the adapters' volume
mounted at the same path in every pod of both pools (a prefill worker without the adapter would
prefill under the base model), BATON_ALLOW_RUNTIME_LORA_UPDATING in every Baton container, and the
whole render valid offline: built-in objects against Kubernetes' schemas (strict), the RayCluster
against KubeRay's CRD (../shared/schemas/), and Helm's strict lint."""

from __future__ import annotations

import posixpath
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest

from cluster.cli import _load, _parser
from cluster.config import BatonConfig
from common.lora import LoRAModuleSpec
from tests.helm.helmlib import (
    CHART,
    CRDS,
    KUBE_VERSIONS,
    crd_errors,
    load_values,
    objects,
    only,
    render,
    variant_objects,
    worker_group,
)

ENV = "BATON_ALLOW_RUNTIME_LORA_UPDATING"
SQL = {"name": "sql", "path": "/adapters/sql-lora"}
CHAT = {"name": "chat", "path": "/adapters/chat-lora", "baseModelName": "meta-llama/Llama-3.1-8B-Instruct"}
TWO_ADAPTERS = {
    "lora": {
        "adapters": [SQL, CHAT],
        "maxLoras": 2,
        "maxLoraRank": 32,
        "maxCpuLoras": 4,
        "allowRuntimeLoraUpdating": True,
        "volume": {"type": "pvc", "mountPath": "/adapters", "pvc": {"claimName": "lora-adapters"}},
    }
}
EXPECTED_SPECS = (
    LoRAModuleSpec("sql", "/adapters/sql-lora"),
    LoRAModuleSpec("chat", "/adapters/chat-lora", "meta-llama/Llama-3.1-8B-Instruct"),
)


def with_values(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def baton_config(objs, tmp_path: Path) -> BatonConfig:
    path = tmp_path / "config.yaml"
    path.write_text(only(objs, "ConfigMap", "baton-config")["data"]["config.yaml"])
    return BatonConfig.load(path)


def pods(objs) -> dict[str, dict]:
    """component -> pod spec: the head, both worker groups, and the router Deployment if any."""
    cluster = only(objs, "RayCluster")
    out = {"head": cluster["spec"]["headGroupSpec"]["template"]["spec"]}
    for role in ("prefill", "decode"):
        out[role] = worker_group(cluster, role)["template"]["spec"]
    for deployment in (o for o in objs if o["kind"] == "Deployment"):
        out["router"] = deployment["spec"]["template"]["spec"]
    return out


def adapter_volume(spec: dict) -> tuple[dict, dict]:
    """(the pod's lora-adapters volume, its main container's mount of it)."""
    (volume,) = [v for v in spec["volumes"] if v["name"] == "lora-adapters"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "lora-adapters"]
    return volume, mount


def env_of(spec: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in spec["containers"][0].get("env", [])}


def assert_valid(objs, values) -> None:
    assert crd_errors(only(objs, "RayCluster")) == []
    for version in KUBE_VERSIONS:
        for obj in objs:
            if (obj["apiVersion"], obj["kind"]) not in CRDS:
                assert kubernetes_validate.validate(obj, version, strict=True) == version, obj["metadata"]["name"]
    report = helm_python.lint(CHART, values=values, strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}.0")
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report


@pytest.mark.parametrize("separate", [False, True], ids=["routers-in-head", "router-deployment"])
def test_two_adapters_reach_both_pools_and_validate(separate, tmp_path):
    values = with_values(TWO_ADAPTERS, {"router": {"separate": separate}})
    values["lora"] = {**values["lora"], "allowRuntimeLoraUpdating": not separate}  # one router only: see below
    objs = objects(render(values))

    # Baton's loader reads the adapters back as --lora-modules gives them (one worker config: both pools).
    engine = baton_config(objs, tmp_path).worker_engine_config()
    assert engine.lora_enabled and engine.enable_lora
    assert engine.lora_specs == EXPECTED_SPECS
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (2, 32, 4)
    # The same as `baton serve --enable-lora --lora-modules sql=... {"name": "chat", ...} --max-loras 2 ...`.
    argv = ["serve", "--enable-lora", "--lora-modules", "sql=/adapters/sql-lora"]
    argv += ['{"name": "chat", "path": "/adapters/chat-lora", "base_model_name": "meta-llama/Llama-3.1-8B-Instruct"}']
    argv += ["--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4"]
    flags = _load(_parser().parse_args(argv)).engine
    assert (flags.lora_specs, flags.max_loras, flags.max_lora_rank, flags.max_cpu_loras) == (
        engine.lora_specs,
        engine.max_loras,
        engine.max_lora_rank,
        engine.max_cpu_loras,
    )

    specs = pods(objs)
    assert set(specs) == ({"head", "prefill", "decode", "router"} if separate else {"head", "prefill", "decode"})
    for component, spec in specs.items():
        volume, mount = adapter_volume(spec)
        assert volume == {
            "name": "lora-adapters",
            "persistentVolumeClaim": {"claimName": "lora-adapters", "readOnly": True},
        }, component
        assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}, component
        # Every adapter's folder lies on that mount, in every pod.
        for adapter in EXPECTED_SPECS:
            assert posixpath.commonpath([adapter.path, mount["mountPath"]]) == mount["mountPath"], (component, adapter)
        assert env_of(spec).get(ENV) == (None if separate else "1"), component
    for role in ("prefill", "decode"):  # and the model is still there beside them (none here: in the image)
        assert [m["name"] for m in specs[role]["containers"][0]["volumeMounts"]] == ["dshm", "lora-adapters"]
    assert_valid(objs, values)


def test_the_ci_variant_serves_two_adapters_from_a_pvc(tmp_path):
    variant = CHART / "ci" / "gpu-lora-values.yaml"
    values = load_values(variant)
    objs = variant_objects(variant)
    engine = baton_config(objs, tmp_path).worker_engine_config()
    assert [s.name for s in engine.lora_specs] == [a["name"] for a in values["lora"]["adapters"]]
    assert engine.lora_specs[1].base_model_name == "llama-3.1-8b-instruct"
    for component, spec in pods(objs).items():
        _, mount = adapter_volume(spec)
        assert all(s.path.startswith(mount["mountPath"] + "/") for s in engine.lora_specs), component
        assert {"model", "lora-adapters"} <= {m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert env_of(spec)[ENV] == "1", component


def test_without_lora_values_nothing_changes(tmp_path):
    objs = variant_objects(None)
    engine = baton_config(objs, tmp_path).engine
    assert not engine.lora_enabled and engine.lora_modules is None
    for component, spec in pods(objs).items():
        assert all(v["name"] != "lora-adapters" for v in spec["volumes"]), component
        assert ENV not in env_of(spec), component
    assert "LoRA" not in render()["baton/templates/NOTES.txt"]


def test_enable_lora_alone_serves_run_time_adapters_only(tmp_path):
    values = {"lora": {"enableLora": True, "allowRuntimeLoraUpdating": True}}
    objs = objects(render(values))
    engine = baton_config(objs, tmp_path).engine
    assert engine.enable_lora and engine.lora_specs == ()
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (1, 16, None)  # Baton's defaults
    for component, spec in pods(objs).items():
        assert env_of(spec)[ENV] == "1", component
    notes = render(values)["baton/templates/NOTES.txt"]
    assert "/v1/load_lora_adapter" in notes and "/v1/unload_lora_adapter" in notes


@pytest.mark.parametrize(
    "volume, expected",
    [
        (
            {"type": "hostPath", "hostPath": {"path": "/mnt/adapters"}},
            {"hostPath": {"path": "/mnt/adapters", "type": "Directory"}},
        ),
        (
            {"type": "custom", "custom": {"nfs": {"server": "nfs.example.com", "path": "/exports/adapters"}}},
            {"nfs": {"server": "nfs.example.com", "path": "/exports/adapters"}},
        ),
        (
            {"type": "pvc", "readOnly": False, "pvc": {"claimName": "shared", "subPath": "lora"}},
            {"persistentVolumeClaim": {"claimName": "shared", "readOnly": False}},
        ),
    ],
    ids=["hostPath", "custom-nfs", "pvc-subPath"],
)
def test_each_volume_type_is_mounted_in_every_pod_and_validates(volume, expected, tmp_path):
    values = {"lora": {"adapters": [SQL], "volume": volume}, "router": {"separate": True}}
    objs = objects(render(values))
    assert baton_config(objs, tmp_path).engine.lora_specs == (LoRAModuleSpec("sql", "/adapters/sql-lora"),)
    for component, spec in pods(objs).items():
        got, mount = adapter_volume(spec)
        assert got == {"name": "lora-adapters", **expected}, component
        assert mount["mountPath"] == "/adapters", component
        assert mount.get("readOnly", False) == volume.get("readOnly", True), component
        assert mount.get("subPath") == volume.get("pvc", {}).get("subPath"), component
        assert ENV not in env_of(spec), component  # run-time loading stays off unless asked for
    assert_valid(objs, values)


def test_adapters_on_the_models_volume_need_no_volume_of_their_own(tmp_path):
    values = {
        "modelSource": {"type": "pvc", "mountPath": "/models", "pvc": {"claimName": "models"}},
        "baton": {"model": "/models/llama"},
        "lora": {"adapters": [{"name": "sql", "path": "/models/adapters/sql"}]},
    }
    objs = objects(render(values))
    assert baton_config(objs, tmp_path).engine.lora_specs == (LoRAModuleSpec("sql", "/models/adapters/sql"),)
    for spec in pods(objs).values():
        assert all(v["name"] != "lora-adapters" for v in spec["volumes"])
        assert any(m["mountPath"] == "/models" for m in spec["containers"][0]["volumeMounts"])


def test_a_user_set_env_var_is_not_doubled():
    values = with_values(TWO_ADAPTERS, {"env": [{"name": ENV, "value": "true"}]})
    for component, spec in pods(objects(render(values))).items():
        names = [e["name"] for e in spec["containers"][0]["env"]]
        assert names.count(ENV) == 1 and env_of(spec)[ENV] == "true", component


def test_notes_list_the_adapters():
    notes = render(TWO_ADAPTERS)["baton/templates/NOTES.txt"]
    assert "sql: /adapters/sql-lora" in notes and "chat: /adapters/chat-lora" in notes
    assert '"model": "sql"' in notes
    assert '"lora_path": "/adapters/my-adapter"' in notes


def test_baton_engine_keys_may_still_be_set_directly(tmp_path):
    values = {"baton": {"engine": {"enable_lora": True, "lora_modules": "sql=/adapters/sql-lora", "max_loras": 2}}}
    engine = baton_config(objects(render(values)), tmp_path).engine
    assert engine.lora_specs == (LoRAModuleSpec("sql", "/adapters/sql-lora"),) and engine.max_loras == 2
    # The same values given both ways agree.
    same = with_values(values, {"lora": {"adapters": [SQL], "maxLoras": 2}})
    assert baton_config(objects(render(same)), tmp_path).engine.lora_specs == engine.lora_specs


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lora": {"adapters": [SQL, {**SQL, "path": "/adapters/other"}]}}, 'the name "sql" is listed twice'),
        ({"lora": {"allowRuntimeLoraUpdating": True}}, "lora.allowRuntimeLoraUpdating needs LoRA on"),
        ({"lora": {"adapters": [SQL], "maxLoras": 4, "maxCpuLoras": 2}}, r"lora.maxCpuLoras \(2\) must be at least"),
        (
            {"lora": {"adapters": [SQL]}, "baton": {"engine": {"lora_modules": "other=/adapters/other"}}},
            "baton.engine.lora_modules is other=/adapters/other, but the chart sets it",
        ),
        (
            {"lora": {"enableLora": True, "allowRuntimeLoraUpdating": True}, "router": {"separate": True}},
            "lora.allowRuntimeLoraUpdating needs a single router process",
        ),
        (
            {"lora": {"enableLora": True, "allowRuntimeLoraUpdating": True}, "router": {"apiServerCount": 2}},
            "lora.allowRuntimeLoraUpdating needs a single router process",
        ),
        (
            {"lora": {"enableLora": True}, "baton": {"engine": {"enable_lora": False}}},
            "baton.engine.enable_lora is false, but the chart sets it to true",
        ),
        ({"lora": {"adapters": [SQL], "volume": {"type": "pvc"}}}, "lora.volume.pvc.claimName is required"),
        ({"lora": {"adapters": [SQL], "volume": {"type": "hostPath"}}}, "lora.volume.hostPath.path is required"),
        ({"lora": {"adapters": [SQL], "volume": {"type": "custom"}}}, "lora.volume.custom is required"),
        (
            {
                "modelSource": {"type": "hostPath", "mountPath": "/models", "hostPath": {"path": "/mnt/m"}},
                "lora": {
                    "adapters": [SQL],
                    "volume": {"type": "hostPath", "mountPath": "/models/", "hostPath": {"path": "/a"}},
                },
            },
            "lora.volume.mountPath and modelSource.mountPath are both",
        ),
    ],
    ids=[
        "duplicate-name",
        "runtime-without-lora",
        "cpu-below-slots",
        "conflicting-modules",
        "runtime-with-router-pods",
        "runtime-with-several-api-servers",
        "conflicting-enable",
        "pvc-without-claim",
        "hostPath-without-path",
        "empty-custom",
        "same-mount-as-model",
    ],
)
def test_the_chart_refuses_what_would_not_serve(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


@pytest.mark.parametrize(
    "values, field",
    [
        ({"lora": {"adapters": [{"name": "my sql", "path": "/adapters/sql"}]}}, "/lora/adapters/0/name"),
        ({"lora": {"adapters": [{"name": "a=b", "path": "/adapters/sql"}]}}, "/lora/adapters/0/name"),
        ({"lora": {"adapters": [{"name": "sql"}]}}, "/lora/adapters/0"),
        ({"lora": {"adapters": [{"name": "sql", "path": "adapters/sql"}]}}, "/lora/adapters/0/path"),
        ({"lora": {"adapters": [{**SQL, "base_model_name": "x"}]}}, "/lora/adapters/0"),
        ({"lora": {"maxLoras": 0}}, "/lora/maxLoras"),
        ({"lora": {"maxLoraRank": "16"}}, "/lora/maxLoraRank"),
        ({"lora": {"volume": {"type": "nfs"}}}, "/lora/volume/type"),
        ({"lora": {"volume": {"mountPath": "adapters"}}}, "/lora/volume/mountPath"),
        ({"lora": {"enabled": True}}, "/lora"),
    ],
)
def test_the_schema_rejects_bad_lora_values_naming_the_field(values, field):
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    assert field in str(caught.value), str(caught.value)
