"""`baton env`: the bug-report environment runs on a machine without a GPU, loads no model and
starts no Ray, and reports each field."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from cluster import env_report
from cluster.env_report import EnvReport, GPUInfo, RayInfo, collect, format_text
from kernels.ops import KernelOps


@pytest.fixture(scope="module")
def report() -> EnvReport:
    return collect()


def test_collects_without_errors_and_without_loading_a_model_or_ray(report):
    assert report.python.startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert report.torch and report.baton
    # In a fresh process: collect() imports neither Ray nor the model's modules.
    code = (
        "import sys; from cluster.env_report import collect; collect(); "
        "print([m for m in ('ray', 'workers.engine.llm_engine', 'workers.engine.model_runner', 'workers.models.llama') "
        "if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_versions_and_devices(report):
    import torch

    assert report.torch == torch.__version__
    assert report.cuda_available == torch.cuda.is_available()
    if not report.cuda_available:  # this machine: no GPU, so no driver, no NCCL, no GPUs
        assert report.gpus == [] and report.device == "cpu"
        assert report.nccl == "not available"
    for gpu in report.gpus:
        assert isinstance(gpu, GPUInfo) and gpu.sm.startswith("sm_") and gpu.memory_bytes > 0


def test_every_kernel_op_has_an_implementation_and_a_reason(report):
    ops = {o.op: o for o in report.ops}
    expected = {f.name for f in dataclasses.fields(KernelOps)} - {"backend"}
    assert expected <= set(ops)
    assert report.resolved_backend in ("triton", "native", "reference")
    for o in report.ops:
        assert o.implementation in ("triton", "native", "reference") and o.reason and o.source.startswith("kernels/")
    if report.device == "cpu":
        assert report.resolved_backend == "native"
        # No native kernel exists for the FP8 ops: they run the PyTorch reference, and say so.
        assert ops["fp8_gemm"].implementation == "reference" and "no native C++ kernel" in ops["fp8_gemm"].reason
        native = [o for o in report.ops if o.implementation == "native"]
        assert all(o.source.startswith("kernels/csrc/") for o in native)
        assert report.fp8.startswith("CPU: FP8")


def test_the_reference_backend_resolves_every_op_to_the_reference():
    ops = collect(kernel_backend="reference").ops
    assert {o.implementation for o in ops if o.op in {f.name for f in dataclasses.fields(KernelOps)}} == {"reference"}


def test_without_an_address_ray_is_not_asked(report):
    assert report.ray == RayInfo(None, False, report.ray.message) and "no Ray address given" in report.ray.message


def test_an_unreachable_address_is_reported_not_raised():
    info = env_report._ray("127.0.0.1:1")
    assert not info.connected and "cannot reach Ray at 127.0.0.1:1" in info.message


def test_the_text_report_names_each_field(report):
    text = format_text(report)
    for heading in (
        "Python:",
        "PyTorch:",
        "Triton:",
        "CUDA available:",
        "NVIDIA driver:",
        "NCCL:",
        "GPUs:",
        "Kernels:",
        "FP8:",
        "Ray:",
    ):
        assert heading in text, heading
    for o in report.ops:
        assert o.op in text
    if not report.cuda_available:
        assert "NVIDIA driver: not available" in text and "GPUs: none visible" in text


def test_a_cluster_and_gpus_print_their_nodes_and_custom_resources(report):
    described = dataclasses.replace(
        report,
        gpus=[GPUInfo(0, "NVIDIA H100 80GB HBM3", "9.0", "sm_90", 80 << 30, True)],
        ray=RayInfo(
            "auto",
            True,
            "1 alive node(s) of 1",
            [
                {
                    "node_id": "abc",
                    "address": "10.0.0.1",
                    "alive": True,
                    "labels": {},
                    "resources": {"CPU": 8.0, "GPU": 1.0, "baton_decode": 1.0},
                }
            ],
            {"baton_decode": 1.0},
        ),
    )
    text = format_text(described)
    assert "0: NVIDIA H100 80GB HBM3, compute capability 9.0 (sm_90), 80.0 GiB, FP8 yes" in text
    assert "abc 10.0.0.1 alive: CPU=8, GPU=1, baton_decode=1" in text and "custom resources: baton_decode=1" in text


@pytest.mark.slow  # `baton env` in a child process: about 4 s here
def test_baton_env_json_in_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "env", "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {f.name for f in dataclasses.fields(EnvReport)} == set(data)
    assert data["ray"]["address"] is None and isinstance(data["ops"], list) and data["ops"]
