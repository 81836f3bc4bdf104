"""FP8 (float8_e4m3fn) weights.

Three ways a linear layer ends up in FP8:

- load-time quantization of a float checkpoint (`EngineConfig.quantization = "fp8"`): every
  nn.Linear of the decoder becomes an `Fp8Linear` with one scale per output channel
  (amax of the row / 448), as vLLM's `--quantization fp8` does;
- a pre-quantized Hugging Face checkpoint with `quantization_config.quant_method == "fp8"`
  (block-wise scales, usually 128x128, stored as `weight_scale_inv`, DeepSeek/Qwen3-FP8 style);
- a compressed-tensors checkpoint (`quant_method == "compressed-tensors"`, format
  `float-quantized`) with per-channel, per-tensor or block `weight_scale`.

All three share one representation: `weight` float8_e4m3fn [N, K] and `weight_scale` float32
[N, G], one scale per output row and group of K / G input columns (G = 1 except for block
scales). Block scales are expanded along rows at load time (3% of the weight bytes) so that the
fused q/k/v and gate/up matrices can be concatenated whatever the row block alignment.

On the CPU the weight is dequantized at each call (weight-only FP8: activations stay in the
model dtype). torch's own float8 -> float cast is slow on the CPU, so the cast here is done with
integer bit operations through float16, exact for every finite e4m3 value. With the Triton
kernels, per-channel layers run the W8A8 `fp8_gemm` kernel.

Modules that hold FP8-quantizable weights outside nn.Linear (an MoE block's stacked experts) say
so by subclassing `Fp8Weights`; `FP8` is the method workers.quantization.registry registers as "fp8".
FP8 KV cache scales are calibrated in workers/engine/kv_calibration.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kernels.ops import KernelOps
from workers.quantization.packed_linear import PackedLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Below this an all-zero row would get a zero scale and divide by it.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")  # quantization_config.quant_method we read


# ---- FP8 arithmetic -------------------------------------------------------------------------
def fp8_to_float(w: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, divided by 256 (callers fold the 256 into their scale).

    e4m3 (bias 7) shifted left by 7 bits is the float16 (bias 15) with the same sign, exponent
    field and mantissa, i.e. the value times 2^(7-15) = 1/256; subnormals map to subnormals.
    Exact for every finite value; NaN (never in weights) would come out finite.
    """
    # Sign-extended to int16 then shifted left by 7: sign in bit 15, exponent and mantissa in
    # bits 7-13, and a stray copy of the sign in bit 14, which the mask (0xBFFF) clears.
    # In-place ops: each pass over the weight costs as much as the matrix product itself.
    h = w.view(torch.int8).to(torch.int16)
    h.bitwise_left_shift_(7).bitwise_and_(-16385)
    return h.view(torch.float16).float()


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [N, 1]) with scale = row amax / 448."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """float32 [N, K] from FP8 weight [N, K] and scale [N, G]: column j uses scale[:, j // group_size]
    (G = ceil(K / group_size); the last group may be narrower). group_size defaults to K."""
    n, k = weight.shape
    groups = weight_scale.shape[1]
    w = fp8_to_float(weight)
    scale = weight_scale.float() * 256.0
    if groups == 1:
        return w * scale
    size = group_size or k
    if groups != -(-k // size):
        raise ValueError(
            f"weight_scale has {groups} column groups; {k} columns in groups of {size} need {-(-k // size)}"
        )
    if k % size == 0:
        return (w.view(n, groups, size) * scale[:, :, None]).view(n, k)
    return w * scale.repeat_interleave(size, dim=1)[:, :k]


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight).T + bias with an FP8 weight and float32 scales [N, G], one per row and
    group of group_size input columns (G = 1, group_size = in_features: per output channel).

    ops: the model's kernels; with Triton ones, per-channel layers quantize the activations and
    run the W8A8 GEMM, otherwise (and without ops) the weight is dequantized at each call."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int | None = None,
        device=None,
        bias_dtype: torch.dtype = torch.float32,
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size or in_features
        groups = -(-in_features // self.group_size)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(out_features, groups, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, ops: KernelOps | None = None) -> Fp8Linear:
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            None,
            device=linear.weight.device,
            bias_dtype=linear.weight.dtype,
            ops=ops,
        )
        q, scale = quantize_per_channel(linear.weight)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        if linear.bias is not None:
            assert layer.bias is not None  # made with a bias as linear has one
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if ops is not None and ops.backend == "triton" and self.weight_scale.shape[1] == 1:
            # Hopper path: per-token dynamic activation scales, per-channel weight scales.
            x2 = x.reshape(-1, self.in_features)
            a, scale_a = ops.scaled_fp8_quant(x2, per_token=True)
            out = ops.fp8_gemm(a, self.weight, scale_a, self.weight_scale, x.dtype, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.weight_scale.shape[1] == 1:
            # Per-channel scales commute with the product: scale the [M, N] output, not the
            # [N, K] weight (one pass less over the weight; the 256 of fp8_to_float goes along).
            out = F.linear(x, fp8_to_float(self.weight).to(x.dtype)) * (self.weight_scale * 256.0).to(x.dtype).t()
            return out if bias is None else out + bias
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}"


class Fp8Weights(ABC):
    """A module with weights of its own outside nn.Linear that the FP8 method quantizes (an MoE
    block's stacked experts): the method finds them by this base class, never by probing names."""

    @abstractmethod
    def prepare_fp8_checkpoint(self, quant: CheckpointQuantization) -> None:
        """Make empty FP8 weights and float32 scales for a pre-quantized checkpoint to fill."""

    @abstractmethod
    def quantize_fp8(self) -> None:
        """Quantize the loaded float weights (`--quantization fp8`)."""

    @abstractmethod
    def fp8_params(self) -> list[nn.Parameter]:
        """The tensors a dtype cast must leave as they are (none before quantization)."""


def _replace_linears(model: nn.Module, make) -> int:
    """Replace the nn.Linear children of every module, except those it lists in `float_children`."""
    count = 0
    for parent in list(model.modules()):
        keep = getattr(parent, "float_children", ())
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name not in keep:
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize_linears(model: nn.Module, ops: KernelOps | None = None) -> int:
    """Replace every nn.Linear (loaded, float) by a per-channel Fp8Linear running on `ops`, and
    quantize the modules that hold weights of their own (Fp8Weights: an MoE block's experts);
    returns how many linear layers were replaced."""
    count = _replace_linears(model, lambda linear: Fp8Linear.from_linear(linear, ops))
    for module in list(model.modules()):
        if isinstance(module, Fp8Weights):
            module.quantize_fp8()
    return count


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype) except FP8 weights and their float32 scales, which keep their dtypes."""
    keep = set()
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            keep |= {id(module.weight), id(module.weight_scale)}
        if isinstance(module, Fp8Weights):
            keep |= {id(p) for p in module.fp8_params()}
    for p in model.parameters():
        if id(p) not in keep and p.dtype.is_floating_point and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


# ---- pre-quantized checkpoints ----------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's FP8 linear weights are scaled.

    strategy: "block" (scales per block_rows x block_cols tile), "channel" (per output row) or
    "tensor" (one per matrix; q/k/v and gate/up each keep their own in the fused matrices).
    """

    method: str
    strategy: str
    block_rows: int = 0
    block_cols: int = 0

    def groups(self, in_features: int) -> int:
        return -(-in_features // self.block_cols) if self.strategy == "block" else 1

    def group_size(self, in_features: int) -> int:
        return self.block_cols if self.strategy == "block" else in_features

    def expand_scale(self, scale: torch.Tensor, rows: int, in_features: int, name: str) -> torch.Tensor:
        """The checkpoint's scale for a [rows, in_features] weight as float32 [rows, groups]."""
        scale = scale.float()
        groups = self.groups(in_features)
        if self.strategy == "tensor" or scale.numel() == 1:
            if scale.numel() != 1:
                raise ValueError(f"{name}: per-tensor scale must have one element, got shape {tuple(scale.shape)}")
            return scale.reshape(1, 1).expand(rows, groups).clone()
        if self.strategy == "channel":
            if scale.numel() != rows:
                raise ValueError(f"{name}: per-channel scale has shape {tuple(scale.shape)}, expected [{rows}, 1]")
            return scale.reshape(rows, 1)
        want = (-(-rows // self.block_rows), groups)
        if tuple(scale.shape) != want:
            raise ValueError(
                f"{name}: block scale has shape {tuple(scale.shape)}, expected {list(want)} for a "
                f"[{rows}, {in_features}] weight with {self.block_rows}x{self.block_cols} blocks"
            )
        return scale.repeat_interleave(self.block_rows, dim=0)[:rows].contiguous()


def parse_quantization_config(config: dict | None) -> CheckpointQuantization | None:
    """Read config.json's `quantization_config`; None for float checkpoints.

    Raises ValueError, naming what is supported, for anything this loader cannot read exactly.
    """
    if not config:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quant_method fp8 with fmt {config.get('fmt')!r} is not supported (only e4m3)")
        block = config.get("weight_block_size")
        if block is None:
            return CheckpointQuantization("fp8", "tensor")
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"weight_block_size must be [rows, cols], got {block!r}")
        return CheckpointQuantization("fp8", "block", int(block[0]), int(block[1]))
    if method == "compressed-tensors":
        fmt = config.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (only float-quantized FP8)")
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (only one)")
        weights = groups[0].get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights {weights!r} are not supported (only type float, num_bits 8)")
        strategy = weights.get("strategy")
        if strategy in ("channel", "tensor"):
            return CheckpointQuantization("compressed-tensors", strategy)
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            return CheckpointQuantization("compressed-tensors", "block", int(block[0]), int(block[1]))
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported (channel, tensor, block)")
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported; supported: {', '.join(CHECKPOINT_METHODS)}"
    )


def prepare_for_checkpoint(model: nn.Module, quant: CheckpointQuantization, ops: KernelOps | None = None) -> int:
    """Replace every nn.Linear by an empty Fp8Linear (running on `ops`) the checkpoint's FP8 tensors load
    into, and let the modules that hold other FP8 weights (Fp8Weights: MoE experts) make theirs."""
    for module in list(model.modules()):
        if isinstance(module, Fp8Weights):
            module.prepare_fp8_checkpoint(quant)

    def make(linear: nn.Linear) -> Fp8Linear:
        weight_device = linear.weight.device
        device = None if weight_device.type == "meta" else weight_device
        return Fp8Linear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            quant.group_size(linear.in_features),
            device=device,
            bias_dtype=linear.weight.dtype,
            ops=ops,
        )

    return _replace_linears(model, make)


# ---- memory accounting ------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightMemory:
    """Bytes held by a model's tensors (measured, not computed from a formula)."""

    linear_bytes: int  # decoder linear layers: weights, scales, biases
    other_bytes: int  # embeddings, norms, untied lm_head
    linear_params: int  # elements of the linear weight matrices

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.other_bytes


def weight_memory(model: nn.Module) -> WeightMemory:
    """The model's parameters by kind. A prepacked layer (workers.quantization.packed_linear) counts its weight
    once, like the nn.Linear it replaced; its packed copy is a buffer, not counted here."""
    linear_ids = set()
    linear_params = 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, Fp8Linear, PackedLinear)):
            linear_params += module.weight.numel()
            linear_ids |= {id(p) for p in module.parameters(recurse=False)}
    linear = other = 0
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        if id(p) in linear_ids:
            linear += nbytes
        else:
            other += nbytes
    return WeightMemory(linear, other, linear_params)


class Fp8Method:
    """FP8 weights as a workers.quantization.registry.QuantizationMethod (registered as "fp8")."""

    def parse_checkpoint(self, quantization_config: dict) -> CheckpointQuantization | None:
        return parse_quantization_config(quantization_config)

    def prepare_checkpoint(self, model: nn.Module, scheme: CheckpointQuantization, ops: KernelOps | None = None) -> int:
        return prepare_for_checkpoint(model, scheme, ops)

    def quantize(self, model: nn.Module, ops: KernelOps | None = None) -> int:
        return quantize_linears(model, ops)

    def cast(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        return cast_model(model, dtype)

    def weight_memory(self, model: nn.Module) -> WeightMemory:
        return weight_memory(model)


FP8 = Fp8Method()
