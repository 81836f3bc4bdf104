"""Start-up decisions about the engine's accelerator, made from a described device so they run on the CPU.

- `check_fp8_config`: FP8 (`--kv-cache-dtype fp8`, `--quantization fp8`, FP8 checkpoints) on a
  GPU without native FP8 (compute capability below 8.9: an A100 is sm_80) is refused when the
  worker builds its model, before any kernel launches (the Triton FP8 kernels would fail to compile
  at their first launch), naming the GPU, its capability and the flags to serve with instead. The
  capability rule itself is kernels.plan.fp8_supported, on a kernels.plan.DeviceSpec (write one by
  hand to describe a device: kernels.plan.TARGETS["sm_80"] is an A100).
- `gpu_kv_cache_blocks`: the KV cache a GPU worker gets without `--kv-cache-memory`, vLLM's way:
  `--gpu-memory-utilization` of the device's total memory, less the weights and the profiled
  activation peak, in whole blocks.
"""

from __future__ import annotations

import torch

from kernels.plan import DeviceSpec, fp8_supported

GIB = 1 << 30


def gpu_total_memory(device: torch.device | str) -> int:
    """Total memory of a CUDA device, in bytes."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


def fp8_uses(quantization: str | None, kv_cache_dtype: str, fp8_checkpoint: bool = False) -> list[str]:
    """What of a configuration needs FP8 kernels, as the user wrote it (empty: nothing)."""
    uses = []
    if quantization == "fp8":
        uses.append("--quantization fp8")
    if kv_cache_dtype == "fp8":
        uses.append("--kv-cache-dtype fp8")
    if fp8_checkpoint:
        uses.append("an FP8 checkpoint")
    return uses


def check_fp8_config(
    device: DeviceSpec, quantization: str | None = None, kv_cache_dtype: str = "auto", fp8_checkpoint: bool = False
) -> None:
    """ValueError when the configuration needs FP8 and `device` lacks it (kernels.plan.fp8_supported:
    a GPU below compute capability 8.9). The CPU runs FP8 on its reference kernels: allowed."""
    uses = fp8_uses(quantization, kv_cache_dtype, fp8_checkpoint)
    if not uses or fp8_supported(device):
        return
    alternatives = []
    if quantization == "fp8":
        alternatives.append("serve without --quantization fp8")
    if kv_cache_dtype == "fp8":
        alternatives.append("use --kv-cache-dtype auto")
    if fp8_checkpoint:
        alternatives.append("serve a bfloat16 or float16 checkpoint of the model")
    raise ValueError(
        f"{' and '.join(uses)} needs a GPU with native FP8 (compute capability 8.9 or later: Ada, Hopper, "
        f"Blackwell); this worker's GPU is {device.describe()}. On it, {' and '.join(alternatives)} "
        "(--dtype bfloat16 keeps the memory low)"
    )


def gpu_kv_cache_blocks(
    total_bytes: int, utilization: float, weight_bytes: int, activation_peak_bytes: int, block_bytes: int
) -> int:
    """KV blocks that fit in `utilization` of a device's `total_bytes` once the weights and the
    activation peak are taken out: floor((total * utilization - weights - activations) / block).

    ValueError, with the numbers, when not one block is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if block_bytes < 1 or total_bytes < 1 or weight_bytes < 0 or activation_peak_bytes < 0:
        raise ValueError(
            f"invalid sizes: total {total_bytes}, weights {weight_bytes}, "
            f"activations {activation_peak_bytes}, block {block_bytes} bytes"
        )
    budget = int(total_bytes * utilization)
    left = budget - weight_bytes - activation_peak_bytes
    if left < block_bytes:
        raise ValueError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {utilization} "
            f"of {total_bytes / GIB:.2f} GiB "
            f"is {budget / GIB:.2f} GiB, the weights take {weight_bytes / GIB:.2f} GiB and the activation peak "
            f"{activation_peak_bytes / GIB:.2f} GiB, leaving {max(left, 0) / GIB:.2f} GiB, less than one KV block "
            f"({block_bytes} bytes); raise --gpu-memory-utilization, lower --max-num-batched-tokens, use a "
            "smaller --dtype or --quantization fp8, or give --kv-cache-memory"
        )
    return left // block_bytes
