"""Helpers for the Helm chart's tests (tests/helm): render helm/baton with Helm's own engine (helm-python-sdk,
Helm v4 as a library), offline, for the default values and every ci/*-values.yaml."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "baton"
# Read-only data beside the project (never copied into it): the CRDs of KubeRay and Prometheus Operator.
SHARED_SCHEMAS = ROOT.parent / "shared" / "schemas"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
# None: the chart's defaults alone.
VARIANTS = [None, *VALUES_FILES]
VARIANT_IDS = ["default", *(p.name.removesuffix("-values.yaml") for p in VALUES_FILES)]
KUBE_VERSIONS = ["1.30", "1.33"]
# Custom resources the chart renders, and the CRD in ../shared/schemas/ that defines each.
CRDS = {
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
}
RELEASE = "baton"
NAMESPACE = "llm"


def load_values(variant: Path | None) -> dict[str, Any] | None:
    return None if variant is None else yaml.safe_load(variant.read_text())


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template --is-upgrade=false` gives them."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values=values, name=name, namespace=NAMESPACE, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects of a render (NOTES.txt and empty documents left out)."""
    out: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        out.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return out


@functools.cache
def _rendered_variant(variant: Path | None) -> tuple[dict[str, Any], ...]:
    return tuple(objects(render(load_values(variant))))


def variant_objects(variant: Path | None) -> list[dict[str, Any]]:
    """The objects of one values variant (a fresh copy: tests may change them)."""
    return copy.deepcopy(list(_rendered_variant(variant)))


def only(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def worker_group(raycluster: dict[str, Any], role: str) -> dict[str, Any]:
    (group,) = [g for g in raycluster["spec"]["workerGroupSpecs"] if g["groupName"] == role]
    return group


def crd_schema(filename: str) -> dict[str, Any]:
    path = SHARED_SCHEMAS / filename
    if not path.is_file():
        pytest.skip(
            f"{path} is absent: the CRD schemas live in ../shared/schemas/ beside the project "
            f"(not in a plain clone); the built-in objects are still checked"
        )
    return _crd_schema(filename)


@functools.cache
def _crd_schema(filename: str) -> dict[str, Any]:
    """The v1 openAPIV3Schema of a CRD in ../shared/schemas/, made strict: unknown fields are
    rejected wherever the CRD lists properties and does not preserve unknown fields (what
    kubeconform's strict mode does)."""
    crd = yaml.load((SHARED_SCHEMAS / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return schema


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Where `obj` breaks its (strict) CRD schema: one "path: message" per error."""
    validator = jsonschema.Draft7Validator(crd_schema(CRDS[(obj["apiVersion"], obj["kind"])]))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
