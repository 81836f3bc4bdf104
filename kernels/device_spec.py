"""The device a launch plan is chosen for: `DeviceSpec` (a real device queried, CUDA only for a CUDA
device, or one described by hand), the described `TARGETS` the compile check and the docs table use,
and the FP8 capability rule (`fp8_supported`, `check_fp8_supported`). Nothing here touches a GPU
unless asked about a CUDA device. The plans themselves: kernels/plan.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels._triton_compat import interpreting

__all__ = ["KIB", "TARGETS", "DeviceSpec", "check_fp8_supported", "fp8_supported"]


@dataclass(frozen=True)
class DeviceSpec:
    """What the launch choices depend on. `interpreted`: the Triton interpreter runs the kernels
    (TRITON_INTERPRET=1), which changes how bfloat16 dots are fed (see decode_attention_plan)."""

    kind: str = "cpu"  # "cuda" or "cpu"
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability (major, minor); (0, 0) on the CPU
    sm_count: int = 4  # streaming multiprocessors (the CPU's 4 sizes the interpreter's split-K)
    smem_per_block: int = 0  # bytes of shared memory one block may opt into (0 on the CPU)
    max_threads: int = 1024  # threads per block
    name: str = ""  # the device's marketing name, for messages
    interpreted: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> DeviceSpec:
        """The spec of a real device; queries CUDA only for a CUDA device."""
        return _spec_of(torch.device(device), interpreting())

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def arch(self) -> str:
        """ "sm_90", "sm_100", ... or "cpu"."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.is_cuda else "cpu"

    def describe(self) -> str:
        if not self.is_cuda:
            return "the CPU"
        cc = f"compute capability {self.capability[0]}.{self.capability[1]} ({self.arch})"
        return f"{self.name} with {cc}" if self.name else f"a GPU with {cc}"


@functools.lru_cache(maxsize=64)
def _spec_of(device: torch.device, interp: bool) -> DeviceSpec:
    if device.type != "cuda":
        return DeviceSpec("cpu", interpreted=interp)
    index = device.index if device.index is not None else torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    smem = int(getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 0) or 0)
    return DeviceSpec(
        "cuda",
        (int(p.major), int(p.minor)),
        int(p.multi_processor_count),
        smem,
        int(getattr(p, "max_threads_per_block", 1024) or 1024),
        str(p.name),
        interp,
    )


KIB = 1024
# The described targets the compile check and the docs table use (SM counts of a typical part).
TARGETS: dict[str, DeviceSpec] = {
    "sm_80": DeviceSpec("cuda", (8, 0), 108, 163 * KIB, 1024, "NVIDIA A100"),
    "sm_89": DeviceSpec("cuda", (8, 9), 58, 99 * KIB, 1024, "NVIDIA L4"),
    "sm_90": DeviceSpec("cuda", (9, 0), 132, 227 * KIB, 1024, "NVIDIA H100"),
    "sm_100": DeviceSpec("cuda", (10, 0), 148, 227 * KIB, 1024, "NVIDIA B200"),
    "cpu": DeviceSpec("cpu", interpreted=True),
}


def fp8_supported(device: DeviceSpec) -> bool:
    """Native FP8 (e4m3) conversions and MMA: compute capability >= 8.9, or the CPU."""
    return not device.is_cuda or tuple(device.capability) >= (8, 9)


def check_fp8_supported(device: DeviceSpec, what: str = "FP8") -> None:
    """ValueError unless `device` runs the FP8 kernels (KV cache, quantization, GEMM). Configuration
    calls this at start-up, so an A100 is refused with the alternative instead of failing to compile
    at the first launch."""
    if not fp8_supported(device):
        raise ValueError(
            f"{what} needs native FP8, compute capability >= 8.9 (Ada, Hopper, Blackwell); "
            f"{device.describe()} has none: use kv_cache_dtype 'auto' (the model's bfloat16/float16 KV "
            f"cache) and no quantization (quantization=None) on this GPU"
        )
