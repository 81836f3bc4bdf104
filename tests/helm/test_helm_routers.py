"""The chart's router options: routers in the head pod (default, with `router.apiServerCount`
processes) or as a Deployment of their own behind the Service (`router.separate`), and KubeRay's
GCS fault tolerance (`gcsFaultTolerance`). Rendered with Helm's engine and validated offline:
built-in objects against Kubernetes' schemas (strict), the RayCluster against KubeRay's CRD in
../shared/schemas/."""

from __future__ import annotations

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.helm.helmlib import KUBE_VERSIONS, crd_errors, objects, only, render

SEPARATE = {"router": {"separate": True, "replicas": 3, "apiServerCount": 2}}
GCS_FT = {
    "gcsFaultTolerance": {
        "enabled": True,
        "redisAddress": "redis-master.redis:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}},
        "externalStorageNamespace": "baton-prod",
    }
}


def config_of(objs) -> dict:
    return yaml.safe_load(only(objs, "ConfigMap", "baton-config")["data"]["config.yaml"])


def test_by_default_the_head_runs_the_routers_and_no_router_deployment():
    objs = objects(render({"router": {"apiServerCount": 4}}))
    assert not [o for o in objs if o["kind"] == "Deployment"]
    service = only(objs, "Service")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    assert config_of(objs)["placement"]["api_server_count"] == 4
    assert "gcsFaultToleranceOptions" not in only(objs, "RayCluster")["spec"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_separate_routers_are_a_deployment_behind_the_service(kube_version):
    objs = objects(render(SEPARATE))
    deployment = only(objs, "Deployment", "baton-router")
    service = only(objs, "Service")
    for obj in (deployment, service):
        assert kubernetes_validate.validate(obj, kube_version, strict=True) == kube_version
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    # The Service sends traffic to the router pods only, not to the head.
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    head = only(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert not service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    command = container["args"][0]
    assert "ray start --address=baton-head-svc:6379 --num-cpus=0 --num-gpus=0" in command
    assert "baton router --address auto --config /etc/baton/config.yaml --routers 3" in command
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # The config the routers read is the head's (same ConfigMap), with its api_server_count.
    assert {"name": "config", "configMap": {"name": "baton-config"}} in pod["spec"]["volumes"]
    assert config_of(objs)["placement"]["api_server_count"] == 2
    assert crd_errors(only(objs, "RayCluster")) == []


def test_the_service_monitor_follows_the_routers():
    objs = objects(render({**SEPARATE, "serviceMonitor": {"enabled": True}}))
    monitor, service = only(objs, "ServiceMonitor"), only(objs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert crd_errors(monitor) == []


def test_gcs_fault_tolerance_renders_kuberays_options_and_matches_the_crd():
    objs = objects(render({**GCS_FT, **SEPARATE}))
    cluster = only(objs, "RayCluster")
    assert cluster["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis-master.redis:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}},
        "externalStorageNamespace": "baton-prod",
    }
    assert crd_errors(cluster) == []


def test_the_crd_check_catches_a_bad_fault_tolerance_option():
    """The validation above can fail: KubeRay's CRD refuses an unknown field in the options."""
    cluster = only(objects(render(GCS_FT)), "RayCluster")
    cluster["spec"]["gcsFaultToleranceOptions"]["redisPort"] = 6379
    assert any("redisPort" in e for e in crd_errors(cluster))


def test_gcs_fault_tolerance_needs_a_redis_address():
    with pytest.raises(helm_python.HelmError, match="gcsFaultTolerance.redisAddress is required"):
        render({"gcsFaultTolerance": {"enabled": True}})


@pytest.mark.parametrize(
    "values, field",
    [
        ({"router": {"replicas": 0}}, "replicas"),
        ({"router": {"apiServerCount": 0}}, "apiServerCount"),
        ({"router": {"separate": "yes"}}, "separate"),
        ({"gcsFaultTolerance": {"redisHost": "x"}}, "redisHost"),
    ],
)
def test_the_values_schema_rejects_bad_router_values(values, field):
    with pytest.raises(helm_python.HelmError, match=field):
        render(values)
