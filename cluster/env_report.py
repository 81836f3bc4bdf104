"""`baton env`: the report users paste into bug reports (as `vllm collect-env`).

`collect()` returns an `EnvReport`: the versions (Python, torch, triton, CUDA, the driver), each
visible GPU with its compute capability, memory and FP8 support, NCCL, the C++ compiler the native
CPU kernels build with, which implementation every kernel op resolves to on this machine and why
(the same dispatch the engine runs, kernels.ops.kernel_ops), and the Ray cluster's nodes and
custom resources when an address is given. It never loads a model and never starts Ray: without
an address it only says that none was given. `format_text()` is the plain report; `to_dict()`
the `--json` one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.busy_host import cpu_name
from common import envs
from kernels import amx_linear, block_copy, cpu_native
from kernels import ops as kops
from kernels._triton_compat import HAS_TRITON
from kernels.plan import DeviceSpec, fp8_supported
from workers.engine.device import gpu_total_memory

# The Ray resources every node has; the rest are custom (baton_prefill, baton_decode, accelerator types).
_STANDARD_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
NOT_AVAILABLE = "not available"


@dataclass
class GPUInfo:
    index: int
    name: str
    capability: str  # "9.0"
    sm: str  # "sm_90"
    memory_bytes: int
    fp8: bool  # native FP8 (capability >= 8.9)


@dataclass
class OpImplementation:
    op: str  # a KernelOps field, e.g. "paged_decode_attention"
    implementation: str  # "triton", "native", "reference" or "library" (a library's own GPU kernel)
    source: str  # where it lives: a kernels/ module or kernels/csrc/ file
    reason: str


@dataclass
class RayInfo:
    address: str | None
    connected: bool
    message: str  # "no Ray address given", an error, or the cluster's summary
    nodes: list[dict[str, Any]] = field(default_factory=list)  # {node_id, address, alive, resources, labels}
    custom_resources: dict[str, float] = field(default_factory=dict)  # summed over alive nodes


@dataclass
class EnvReport:
    baton: str
    python: str
    platform: str
    cpu: str
    cpu_count: int | None
    torch: str
    torch_cuda: str | None  # the CUDA torch was built with; None for CPU builds
    cuda_available: bool
    driver: str | None
    triton: str | None
    triton_interpret: bool
    nccl: str  # a version, or "not available"
    cxx: str | None  # the compiler the native CPU kernels build with
    gpus: list[GPUInfo]
    kernel_backend: str  # what was asked ("auto")
    device: str  # what the ops resolve for: "cuda" or "cpu"
    resolved_backend: str  # kernels.ops.resolve_backend's answer, or an error
    ops: list[OpImplementation]
    fp8: str
    ray: RayInfo

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", "unknown")


def _baton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("baton-serve")
    except PackageNotFoundError:
        return "unknown (not installed as a package)"


def _driver(torch) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            lines = out.stdout.strip().splitlines()
            if out.returncode == 0 and lines:
                return lines[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def _nccl(torch) -> str:
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            return NOT_AVAILABLE
        v = torch.cuda.nccl.version()
        return ".".join(str(p) for p in v) if isinstance(v, tuple) else str(v)
    except (ImportError, RuntimeError, AttributeError):
        return NOT_AVAILABLE


def _gpus(torch) -> list[GPUInfo]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        d = DeviceSpec.of(f"cuda:{i}")
        out.append(
            GPUInfo(
                i,
                d.name,
                f"{d.capability[0]}.{d.capability[1]}",
                d.arch,
                gpu_total_memory(f"cuda:{i}"),
                fp8_supported(d),
            )
        )
    return out


# Each op's module, and the native C++ source it may run (kernels/csrc/<name>.cpp).
_OP_MODULES = {
    "rms_norm": ("rms_norm", "rms_norm"),
    "rotary_embedding": ("rotary", "rotary"),
    "silu_and_mul": ("silu_mul", "silu_mul"),
    "store_kv": ("kv_store", "kv_store"),
    "paged_decode_attention": ("decode_attention", "paged_decode_attention"),
    "paged_prefill_attention": ("prefill_attention", "paged_prefill_attention"),
    "scaled_fp8_quant": ("fp8_quant", None),
    "fp8_gemm": ("fp8_gemm", None),
    "pack_kv_blocks": ("block_copy", None),
    "unpack_kv_blocks": ("block_copy", None),
    "exponential_race": ("sampling", "exponential_race"),
    "gelu_tanh_and_mul": ("gelu_tanh_and_mul", "gelu_mul"),
    "fused_moe": ("fused_moe", None),
    "apply_token_bitmask": ("token_bitmask", "token_bitmask"),
}


def _implementation(fn) -> str:
    name = getattr(getattr(fn, "func", fn), "__name__", "")  # a functools.partial: the function it wraps
    if name.endswith("_triton"):
        return "triton"
    if name.endswith("_gpu"):  # a library's own GPU kernel (xgrammar's grammar mask)
        return "library"
    if name.endswith("_reference"):
        return "reference"
    return "native"  # kernels.ops._native_or_reference's wrapper


def _native_inputs(module) -> str:
    """What the native kernel handles, from its module's native_available docstring."""
    doc = " ".join((module.native_available.__doc__ or "").split())
    start, end = doc.find("("), doc.rfind(")")
    inputs = doc[start + 1 : end] if 0 <= start < end else "some inputs"
    return inputs.replace(", built library", "").replace("built library", "").strip(" ,")


def _ops(backend: str, device: str) -> tuple[str, list[OpImplementation]]:
    import importlib

    try:
        resolved = kops.resolve_backend(backend, device)
        table = kops.kernel_ops(backend, device)
    except ValueError as exc:
        return f"error: {exc}", []
    out = []
    for f in dataclasses.fields(kops.KernelOps):
        if f.name == "backend":
            continue
        module_name, csrc = _OP_MODULES.get(f.name, (f.name, None))
        module = importlib.import_module(f"kernels.{module_name}")
        impl = _implementation(getattr(table, f.name))
        source = f"kernels/{module_name}.py"
        if impl == "triton":
            reason = "CUDA device with Triton: the Triton kernel"
        elif impl == "library":
            reason = "CUDA device: the library's own GPU kernel (xgrammar's for a grammar's token mask)"
        elif impl == "native":
            source = f"kernels/csrc/{csrc}.cpp"
            reason = (
                f"CPU, native library built: the C++ kernel for {_native_inputs(module)}; "
                "other inputs run the PyTorch reference"
            )
        elif resolved == "reference" and backend == "reference":
            reason = "kernel_backend reference asked: the PyTorch reference"
        elif resolved == "reference":
            reason = (
                f"no Triton kernels for {device} tensors here (triton {'installed' if HAS_TRITON else 'missing'}): "
                "the PyTorch reference"
            )
        elif resolved == "triton":
            reason = "the Triton table keeps the PyTorch reference for this op (one fused pass on CUDA already)"
        elif csrc is None:
            reason = "CPU: no native C++ kernel for this op: the PyTorch reference"
        else:
            reason = (
                f"CPU: the native library kernels/csrc/{csrc}.cpp did not build or load (no C++ compiler, "
                "or an unwritable cache): the PyTorch reference"
            )
        out.append(OpImplementation(f.name, impl, source, reason))
    # Not a KernelOps entry: the shared-memory KV transport's cache-to-cache copy (CPU caches).
    if block_copy.native_built():
        out.append(
            OpImplementation(
                "copy_kv_blocks (shm transport)",
                "native",
                "kernels/csrc/kv_block_copy.cpp",
                "CPU caches, native library built: the C++ copy",
            )
        )
    else:
        out.append(
            OpImplementation(
                "copy_kv_blocks (shm transport)",
                "reference",
                "kernels/block_copy.py",
                "the native library kernels/csrc/kv_block_copy.cpp did not build or load: the PyTorch reference",
            )
        )
    # Not a KernelOps entry either: how the one-call float32 layers project prompt tokens on the CPU.
    if device == "cpu" and amx_linear.ready():
        out.append(
            OpImplementation(
                "float32 prompt projections",
                "native",
                "kernels/csrc/amx_linear.cpp",
                "CPU with AMX-BF16: three bfloat16 products each on the tile unit "
                "(--float32-prompt-matmul ieee: float32 FMAs, as decode rows)",
            )
        )
    elif device == "cpu":
        out.append(
            OpImplementation(
                "float32 prompt projections",
                "native",
                "kernels/csrc/small_m_linear.cpp",
                "no AMX-BF16 here (or the tiles were not granted): float32 FMAs, as decode rows",
            )
        )
    return resolved, out


def _fp8(gpus: list[GPUInfo], device: str) -> str:
    need = "8.9"  # kernels.plan.fp8_supported
    if device != "cuda":
        return (
            "CPU: FP8 (--quantization fp8, --kv-cache-dtype fp8, FP8 checkpoints) runs on the PyTorch "
            f"reference kernels; GPUs need compute capability {need}+ for it"
        )
    parts = [
        f"GPU {g.index} {g.name} ({g.sm}): {'native FP8' if g.fp8 else f'no native FP8 (needs {need}+): refused'}"
        for g in gpus
    ]
    return "; ".join(parts)


def _ray(address: str | None, timeout_s: float = 30.0) -> RayInfo:
    """The cluster at `address`, asked from a child process (ray.init keeps retrying an address
    that does not answer, for minutes): this process never imports Ray, and the query ends after
    timeout_s whatever Ray does."""
    if not address:
        return RayInfo(None, False, "no Ray address given (pass --address auto or HOST:PORT to query a cluster)")
    if address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            return RayInfo(address, False, f"cannot reach Ray at {address}: {exc}")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "cluster.env_report", "--ray-query", address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return RayInfo(address, False, f"cannot reach Ray at {address}: no answer within {timeout_s:g} s")
    try:
        return RayInfo(**json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return RayInfo(address, False, f"cannot query Ray at {address}: {tail}")


def _query_ray(address: str) -> RayInfo:
    """In the child process of _ray: connect to the running cluster (never start one) and list it."""
    try:
        import ray
    except ImportError:
        return RayInfo(address, False, "ray is not installed")
    try:
        # With an address, ray.init connects to a running cluster; it never starts one.
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        nodes = []
        custom: dict[str, float] = {}
        for n in ray.nodes():
            resources = {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")}
            nodes.append(
                {
                    "node_id": n.get("NodeID"),
                    "address": n.get("NodeManagerAddress"),
                    "alive": n.get("Alive"),
                    "resources": resources,
                    "labels": n.get("Labels", {}),
                }
            )
            if n.get("Alive"):
                for k, v in resources.items():
                    if k not in _STANDARD_RESOURCES and not k.startswith("accelerator_type:"):
                        custom[k] = custom.get(k, 0.0) + v
        alive = sum(1 for n in nodes if n["alive"])
        return RayInfo(address, True, f"{alive} alive node(s) of {len(nodes)}", nodes, custom)
    except Exception as exc:  # ConnectionError, version mismatches: report, do not fail
        return RayInfo(address, False, f"cannot reach Ray at {address}: {type(exc).__name__}: {exc}")
    finally:
        if ray.is_initialized():
            ray.shutdown()


def collect(address: str | None = None, kernel_backend: str = "auto") -> EnvReport:
    """The report for this machine (and the Ray cluster at `address`, if given)."""

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpus = _gpus(torch)
    resolved, ops = _ops(kernel_backend, device)
    return EnvReport(
        baton=_baton_version(),
        python=sys.version.split()[0] + f" ({platform.python_implementation()})",
        platform=platform.platform(),
        cpu=cpu_name(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=cuda,
        driver=_driver(torch),
        triton=_version("triton"),
        triton_interpret=envs.triton_interpret(),
        nccl=_nccl(torch),
        cxx=cpu_native.compiler(),
        gpus=gpus,
        kernel_backend=kernel_backend,
        device=device,
        resolved_backend=resolved,
        ops=ops,
        fp8=_fp8(gpus, device),
        ray=_ray(address),
    )


def format_text(report: EnvReport) -> str:
    """The plain report, one `name: value` per line, None written as "not available"."""

    def v(x: Any) -> str:
        return NOT_AVAILABLE if x is None else str(x)

    lines = [
        "Baton environment (baton env)",
        "",
        f"Baton: {report.baton}",
        f"Python: {report.python}",
        f"Platform: {report.platform}",
        f"CPU: {report.cpu} ({v(report.cpu_count)} cores)",
        f"PyTorch: {report.torch}",
        f"CUDA (PyTorch built with): {v(report.torch_cuda)}",
        f"CUDA available: {report.cuda_available}",
        f"NVIDIA driver: {v(report.driver)}",
        f"Triton: {v(report.triton)}" + (" (TRITON_INTERPRET=1: interpreter)" if report.triton_interpret else ""),
        f"NCCL: {report.nccl}",
        f"C++ compiler (native CPU kernels): {v(report.cxx)}",
        "",
        f"GPUs: {len(report.gpus) or 'none visible'}",
    ]
    for g in report.gpus:
        lines.append(
            f"  {g.index}: {g.name}, compute capability {g.capability} ({g.sm}), "
            f"{g.memory_bytes / 2**30:.1f} GiB, FP8 {'yes' if g.fp8 else 'no'}"
        )
    lines += ["", f"Kernels: kernel_backend {report.kernel_backend} on {report.device} -> {report.resolved_backend}"]
    width = max((len(o.op) for o in report.ops), default=0)
    for o in report.ops:
        lines.append(f"  {o.op:<{width}}  {o.implementation:<9} {o.source}: {o.reason}")
    lines += ["", f"FP8: {report.fp8}", "", f"Ray: {report.ray.message}"]
    if report.ray.address:
        lines[-1] = f"Ray ({report.ray.address}): {report.ray.message}"
    for n in report.ray.nodes:
        resources = ", ".join(f"{k}={val:g}" for k, val in sorted(n["resources"].items()))
        lines.append(f"  {n['node_id']} {n['address']} {'alive' if n['alive'] else 'dead'}: {resources}")
    if report.ray.connected:
        custom = ", ".join(f"{k}={val:g}" for k, val in sorted(report.ray.custom_resources.items())) or "none"
        lines.append(f"  custom resources: {custom}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # `python -m cluster.env_report --ray-query ADDRESS`: _ray's child process; one JSON line out.
    if len(sys.argv) == 3 and sys.argv[1] == "--ray-query":
        print(json.dumps(dataclasses.asdict(_query_ray(sys.argv[2]))))
    else:
        print(format_text(collect()), end="")
