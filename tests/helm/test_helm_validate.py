"""Every object the chart renders is valid offline: the built-in ones against Kubernetes' own
schemas (kubernetes-validate, strict: unknown fields rejected) for 1.30 and 1.33, the RayCluster
against KubeRay's CRD and the monitors against the Prometheus Operator's (../shared/schemas/)."""

from __future__ import annotations

import helm_python
import kubernetes_validate
import pytest

from tests.helm.helmlib import (
    CHART,
    CRDS,
    KUBE_VERSIONS,
    VARIANT_IDS,
    VARIANTS,
    crd_errors,
    objects,
    only,
    render,
    variant_objects,
)

# Gateway API's HTTPRoute is a CRD too, but no schema of it is at hand: checked by shape in test_helm_render.


def builtin(objs):
    return [o for o in objs if (o["apiVersion"], o["kind"]) not in CRDS]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_builtin_objects_validate_strictly(variant, kube_version):
    objs = builtin(variant_objects(variant))
    assert {"ConfigMap", "Service", "PodDisruptionBudget"} <= {o["kind"] for o in objs}
    for obj in objs:
        assert kubernetes_validate.validate(obj, kube_version, strict=True) == kube_version, obj["metadata"]["name"]


def test_all_optional_builtin_objects_validate():
    """Ingress, the head's PDB and the emptyDir + init container model source, in one render."""
    values = {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tls": [{"hosts": ["llm.example.com"], "secretName": "tls"}],
            "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
        },
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%", "protectHead": True},
        "service": {"type": "LoadBalancer", "port": 8000, "annotations": {"example.com/lb": "internal"}},
    }
    objs = builtin(objects(render(values)))
    assert sorted(o["kind"] for o in objs) == [
        "ConfigMap",
        "ConfigMap",
        "Ingress",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "Service",
    ]
    for version in KUBE_VERSIONS:
        for obj in objs:
            kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    """The checks above can fail: the same validator refuses a misspelt field."""
    service = only(variant_objects(None), "Service")
    service["spec"]["port"] = 8000  # belongs in spec.ports
    with pytest.raises(kubernetes_validate.ValidationError, match="port"):
        kubernetes_validate.validate(service, "1.33", strict=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_raycluster_matches_kuberays_crd(variant):
    cluster = only(variant_objects(variant), "RayCluster")
    assert crd_errors(cluster) == []


def test_raycluster_with_every_pod_option_matches_kuberays_crd():
    values = {
        "modelSource": {
            "type": "emptyDir",
            "initContainers": [
                {"name": "fetch-model", "image": "busybox:1.37", "command": ["sh", "-c", "cp -r /src/. /models/"]}
            ],
        },
        "imagePullSecrets": [{"name": "registry"}],
        "runtimeClassName": "nvidia",
        "priorityClassName": "inference",
        "podSecurityContext": {"fsGroup": 1001},
        "securityContext": {"allowPrivilegeEscalation": False},
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "envFrom": [{"secretRef": {"name": "baton-env"}}],
        "podLabels": {"team": "ml"},
        "podAnnotations": {"example.com/scrape": "false"},
        "decode": {
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "gpus": 1,
            "env": [{"name": "EXTRA", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "rayStartParams": {"object-store-memory": 1000000000},
        },
        "autoscaling": {"enabled": True},
    }
    cluster = only(objects(render(values)), "RayCluster")
    assert crd_errors(cluster) == []


def test_kuberay_crd_rejects_an_unknown_field():
    cluster = only(variant_objects(None), "RayCluster")
    assert crd_errors(cluster) == []
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["probes"] = {}
    errors = crd_errors(cluster)
    assert any("workerGroupSpecs/0" in e and "'replica'" in e for e in errors), errors
    assert any("containers/0" in e and "'probes'" in e for e in errors), errors


def test_monitors_match_prometheus_operators_crds():
    objs = variant_objects(CHART / "ci" / "gpu-values.yaml")
    for kind in ("ServiceMonitor", "PodMonitor"):
        monitor = only(objs, kind)
        assert crd_errors(monitor) == []
        monitor["spec"]["endpoint"] = []  # misspelt
        assert any("'endpoint'" in e for e in crd_errors(monitor)), kind
    relabelled = objects(
        render(
            {
                "serviceMonitor": {
                    "enabled": True,
                    "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
                }
            }
        )
    )
    assert crd_errors(only(relabelled, "ServiceMonitor")) == []


def test_a_tensor_parallel_render_validates():
    """Per-pool TP sizes (prefill 4 GPUs a pod, decode 2) give a RayCluster KubeRay's CRD accepts and
    built-in objects Kubernetes accepts; Helm's strict lint agrees."""
    eight = {"cpu": "8", "memory": "64Gi"}
    pool = {"gpus": 1, "resources": {"requests": eight, "limits": eight}}
    values = {
        "baton": {"placement": {"tensor_parallel_size": 2, "prefill_tensor_parallel_size": 4, "threads_per_worker": 2}},
        "prefill": pool,
        "decode": pool,
    }
    objs = objects(render(values))
    cluster = only(objs, "RayCluster")
    gpus = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for g in cluster["spec"]["workerGroupSpecs"]
    }
    assert gpus == {"prefill": 4, "decode": 2}
    assert crd_errors(cluster) == []
    for version in KUBE_VERSIONS:
        for obj in builtin(objs):
            assert kubernetes_validate.validate(obj, version, strict=True) == version, obj["metadata"]["name"]
    report = helm_python.lint(CHART, values=values, strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}.0")
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
