"""values.schema.json: self-contained, embeds Baton's own configuration schema as it is now, and
makes Helm refuse bad values with a message naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import helm_python
import jsonschema
import pytest

from cluster.config import json_schema
from tests.helm.helmlib import CHART, VALUES_FILES, load_values, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize(
    "values, field, reason",
    [
        ({"prefill": {"replicas": -1}}, "/prefill/replicas", "minimum"),
        ({"decode": {"replicas": 0}}, "/decode/replicas", "minimum"),  # Baton needs a decode worker
        ({"baton": {"engine": {"quantization": "int4"}}}, "/baton/engine/quantization", "fp8"),
        ({"decode": {"gpus": "2"}}, "/decode/gpus", "got string, want integer"),
        ({"prefill": {"gpus": 1.5}}, "/prefill/gpus", "want integer"),
        ({"replicas": 3}, "additional properties 'replicas' not allowed", ""),
        ({"baton": {"engine": {"blok_size": 32}}}, "/baton/engine", "'blok_size' not allowed"),
        ({"baton": {"placement": {"gpus_per_worker": "1"}}}, "/baton/placement/gpus_per_worker", "string"),
        ({"modelSource": {"type": "s3"}}, "/modelSource/type", "pvc"),
        ({"service": {"port": 70000}}, "/service/port", "maximum"),
    ],
)
def test_helm_rejects_bad_values_naming_the_field(values, field, reason):
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    message = str(caught.value)
    assert field in message and reason in message, message
    report = helm_python.lint(CHART, values=values, strict=True, kube_version="v1.33.0")
    assert any(field in e for e in report["errors"]), report


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.name)
def test_the_schema_accepts_every_variant(values_file):
    with helm_python.Chart.load(CHART) as chart:
        merged = chart.merge_values(load_values(values_file))
        chart.validate_schema(load_values(values_file))
    jsonschema.Draft7Validator(SCHEMA).validate(merged)  # a second, independent validator agrees


def test_the_baton_section_is_baton_config_schema_now():
    """Regenerate with `make helm-schema` when the configuration changes."""
    expected = {k: v for k, v in json_schema().items() if k != "$schema"}
    assert SCHEMA["properties"]["baton"] == expected, "helm/baton/values.schema.json is stale: run `make helm-schema`"


def test_the_sync_script_agrees():
    script = CHART / "scripts" / "sync_values_schema.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_schema_is_self_contained():
    """A remote $ref breaks offline lint: every reference stays inside the document."""
    refs = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(SCHEMA)
    assert all(ref.startswith("#") for ref in refs), refs
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["additionalProperties"] is False
