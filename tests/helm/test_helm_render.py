"""The chart lints clean and renders with Helm's real engine for the defaults and every
ci/*-values.yaml; its appVersion is Baton's package version."""

from __future__ import annotations

import json

import helm_python
import pytest
import tomllib

from tests.helm.helmlib import (
    CHART,
    KUBE_VERSIONS,
    ROOT,
    VALUES_FILES,
    VARIANT_IDS,
    VARIANTS,
    load_values,
    objects,
    only,
    render,
    variant_objects,
    worker_group,
)

WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


def test_the_ci_variants_are_there():
    assert {p.name for p in VALUES_FILES} >= {"cpu-values.yaml", "gpu-values.yaml", "gpu-autoscale-values.yaml"}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_strict_lint_is_clean(variant, kube_version):
    report = helm_python.lint(CHART, values=load_values(variant), strict=True, kube_version=f"v{kube_version}.0")
    assert report["total_charts_linted"] == 1
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert not problems and not report["errors"], json.dumps(report, indent=2)


def test_lint_reports_bad_values():
    """The lint above can fail: the same call flags values the schema rejects."""
    report = helm_python.lint(CHART, values={"decode": {"replicas": -2}}, strict=True, kube_version="v1.33.0")
    assert report["errors"] and any("/decode/replicas" in e for e in report["errors"])


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_every_variant_renders_the_expected_objects(variant):
    kinds = sorted(o["kind"] for o in variant_objects(variant))
    name = VARIANT_IDS[VARIANTS.index(variant)]
    expected = {"RayCluster": 1, "ConfigMap": 2, "Service": 1, "PodDisruptionBudget": 2}
    if name == "gpu":
        expected |= {"Ingress": 1, "ServiceMonitor": 1, "PodMonitor": 1}
    if name == "gpu-autoscale":
        expected |= {"ServiceMonitor": 1, "PodDisruptionBudget": 3}
    assert kinds == sorted(k for k, n in expected.items() for _ in range(n))
    for obj in variant_objects(variant):
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "baton"


def test_gpu_variant_is_an_fp8_8b_llama_on_2_prefill_and_4_decode_gpus():
    objs = variant_objects(CHART / "ci" / "gpu-values.yaml")
    cluster = only(objs, "RayCluster")
    prefill, decode = worker_group(cluster, "prefill"), worker_group(cluster, "decode")
    assert (prefill["replicas"], decode["replicas"]) == (2, 4)
    for group in (prefill, decode):
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    values = load_values(CHART / "ci" / "gpu-values.yaml")
    assert values["baton"]["engine"]["quantization"] == "fp8" and values["baton"]["engine"]["kv_cache_dtype"] == "fp8"
    assert "8B" in values["baton"]["model"]


def test_autoscale_variant_turns_on_kuberays_autoscaler_with_per_pool_bounds():
    values = load_values(CHART / "ci" / "gpu-autoscale-values.yaml")
    cluster = only(variant_objects(CHART / "ci" / "gpu-autoscale-values.yaml"), "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == values["autoscaling"]["idleTimeoutSeconds"]
    for role in ("prefill", "decode"):
        group = worker_group(cluster, role)
        assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (
            values[role]["minReplicas"],
            values[role]["replicas"],
            values[role]["maxReplicas"],
        )
        assert group["minReplicas"] < group["maxReplicas"]
    assert only(variant_objects(None), "RayCluster")["spec"]["enableInTreeAutoscaling"] is False


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_replica_bounds_are_checked(role):
    with pytest.raises(helm_python.HelmError, match=rf"{role}.minReplicas \(3\) must not exceed {role}.replicas"):
        render({role: {"replicas": 2, "minReplicas": 3, "maxReplicas": 4}})
    with pytest.raises(helm_python.HelmError, match=rf"{role}.maxReplicas \(1\) must be at least {role}.replicas"):
        render({role: {"replicas": 2, "minReplicas": 1, "maxReplicas": 1}})


def test_app_version_is_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with helm_python.Chart.load(CHART) as chart:
        assert chart.metadata["appVersion"] == version
    cluster = only(variant_objects(None), "RayCluster")
    assert cluster["metadata"]["labels"]["app.kubernetes.io/version"] == version
    # The default image tag is the appVersion, as `make image` tags it.
    assert cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == f"baton:{version}"


def test_service_reaches_the_routers_port_on_the_head():
    objs = variant_objects(None)
    service = only(objs, "Service")
    head = only(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    for group in only(objs, "RayCluster")["spec"]["workerGroupSpecs"]:  # the Service selects the head alone
        assert not service["spec"]["selector"].items() <= group["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000
    (container,) = head["spec"]["containers"]
    http = {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]]
    assert http == 8000
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "metrics": 8080,
        "http": 8000,
    }


def test_grafana_dashboard_ships_as_a_labelled_configmap():
    dashboard = only(variant_objects(None), "ConfigMap", "baton-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["baton-grafana.json"])
    assert shipped == json.loads((CHART / "dashboards" / "baton-grafana.json").read_text())
    assert shipped["panels"]


def test_monitors_scrape_the_router_and_every_ray_pod():
    objs = variant_objects(CHART / "ci" / "gpu-values.yaml")
    service, cluster = only(objs, "Service"), only(objs, "RayCluster")
    monitor = only(objs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    pods = only(objs, "PodMonitor")
    templates = [g["template"] for g in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]]
    for template in templates:
        assert pods["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert {"name": "metrics", "containerPort": 8080} in template["spec"]["containers"][0]["ports"]


def test_pod_disruption_budgets_select_each_pool():
    objs = variant_objects(None)
    cluster = only(objs, "RayCluster")
    for role in ("prefill", "decode"):
        pdb = only(objs, "PodDisruptionBudget", f"baton-{role}")
        labels = worker_group(cluster, role)["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        other = worker_group(cluster, "decode" if role == "prefill" else "prefill")["template"]["metadata"]["labels"]
        assert not pdb["spec"]["selector"]["matchLabels"].items() <= other.items()


def test_optional_routes():
    rendered = render(
        {
            "httpRoute": {
                "enabled": True,
                "parentRefs": [{"name": "gateway", "namespace": "infra"}],
                "hostnames": ["llm.example.com"],
            }
        }
    )
    route = only(objects(rendered), "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "baton", "port": 8000}]
    assert route["spec"]["parentRefs"] == [{"name": "gateway", "namespace": "infra"}]
    with pytest.raises(helm_python.HelmError, match="httpRoute.parentRefs"):
        render({"httpRoute": {"enabled": True}})
    ingress = only(variant_objects(CHART / "ci" / "gpu-values.yaml"), "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "baton", "port": {"name": "http"}}


def test_notes_tell_how_to_reach_the_router():
    notes = render()["baton/templates/NOTES.txt"]
    assert "port-forward service/baton 8000:8000" in notes
    assert "curl -s http://127.0.0.1:8000/health" in notes
    assert '"model": "SmolLM2-135M-Instruct"' in notes
    gpu = render(load_values(CHART / "ci" / "gpu-values.yaml"))["baton/templates/NOTES.txt"]
    assert '"model": "llama-3.1-8b-instruct"' in gpu
