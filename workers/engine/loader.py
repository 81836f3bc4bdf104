"""Builds an engine's model: the class of its architecture on the kernels and device the engine
config picks, its weights loaded (FP8-quantized or prepacked as configured), and its FP8 KV scales."""

from __future__ import annotations

from typing import TypeVar

import torch

from kernels.ops import kernel_ops
from kernels.plan import DeviceSpec
from kernels.rotary import build_rope_cache
from workers.config import EngineConfig
from workers.engine.device import check_fp8_config
from workers.engine.kv_calibration import calibrate_kv_scales, calibration_token_ids
from workers.models.config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import families, family_for, model_class
from workers.quantization import packed_linear
from workers.quantization.registry import checkpoint_quantization, quantization_method

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def allocate_empty(model: ModuleT, device: torch.device | str) -> ModuleT:
    """`model` (built on the meta device) with uninitialised storage on `device` for every parameter
    and buffer, as `Module.to_empty` gives. to_empty reaches `torch.empty_like` through PyTorch's
    reference ops, whose first call imports sympy: about 0.8 s of every worker's start on a CPU."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(
                module,
                name,
                torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad),
            )
        for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
    return model


def cast_float(model: ModuleT, dtype: torch.dtype) -> ModuleT:
    """The floating-point parameters of a float model (nothing quantized yet) cast to `dtype`."""
    for p in model.parameters():
        if p.dtype.is_floating_point and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def load_model(
    model_config: ModelConfig, engine_config: EngineConfig, weights, max_model_len: int | None = None, tp_group=None
) -> LlamaForCausalLM:
    """Build the model on the kernels engine_config.kernel_backend picks, and load `weights` into it,
    quantized as the config or checkpoint says. With tp_group (workers.parallel), model_config and
    weights are this rank's shard. The family (its class, whether it runs sharded) and the quantization
    method come from their registries (workers.models.registry, workers.quantization.registry).

    Pre-quantized checkpoints load their quantized tensors as they are, through the method that reads
    their `quant_method`; a float checkpoint with engine_config.quantization set (e.g. "fp8") is loaded
    in float, then that method quantizes it.
    On the CPU, plain linear layers are prepacked for oneDNN when engine_config.packed_linear is set.
    """
    device = torch.device(engine_config.device)
    dtype = TORCH_DTYPES[engine_config.dtype]
    checkpoint = checkpoint_quantization(getattr(weights, "quantization_config", None))
    quantize = None  # the method quantizing a float checkpoint at load time
    if checkpoint is None and engine_config.quantization is not None:
        quantize = quantization_method(engine_config.quantization)
    # Before any kernel runs: FP8 on a GPU without native FP8 fails to compile at its first launch.
    check_fp8_config(
        DeviceSpec.of(device),
        engine_config.quantization,
        engine_config.kv_cache_dtype,
        fp8_checkpoint=checkpoint is not None and checkpoint.name == "fp8",
    )
    family = family_for(model_config.architecture)  # refuses an unknown one, naming the supported ones
    if tp_group is not None and not family.tensor_parallel:
        raise ValueError(
            f"{model_config.architecture}: tensor parallelism does not support the {family.name} family yet; "
            f"families with it: {', '.join(f.name for f in families() if f.tensor_parallel)}"
        )
    cls = model_class(model_config.architecture)
    ops = kernel_ops(engine_config.kernel_backend, device)
    with torch.device("meta"):
        # What load_model returns: the built-in families' classes are LlamaForCausalLM or subclass it.
        model: LlamaForCausalLM = cls(model_config, ops) if tp_group is None else cls(model_config, ops, tp_group)
    if checkpoint is not None:
        checkpoint.method.prepare_checkpoint(model, checkpoint.scheme, ops)
    model = allocate_empty(model, device)
    model = checkpoint.method.cast(model, dtype) if checkpoint is not None else cast_float(model, dtype)
    # The rope table stays float32 whatever the model dtype: positions need the precision.
    model.cos_sin_cache = build_rope_cache(
        model_config.head_dim,
        max_model_len or model_config.max_position_embeddings,
        model_config.rope_theta,
        model_config.rope_scaling,
    ).to(device)
    if model_config.local_rope_theta is not None:  # Gemma 3's sliding layers: their own rope base
        model.local_cos_sin_cache = build_rope_cache(
            model_config.head_dim,
            max_model_len or model_config.max_position_embeddings,
            model_config.local_rope_theta,
            model_config.local_rope_scaling,
        ).to(device)
    with torch.no_grad():
        model.load_hf_weights(weights, None if checkpoint is None else checkpoint.scheme)
        if quantize is not None:
            quantize.quantize(model, ops)
        if device.type == "cpu" and engine_config.packed_linear:
            packed_linear.prepack(model)
    return model.eval()


def kv_cache_scales(
    model: LlamaForCausalLM, engine_config: EngineConfig, weights=None
) -> tuple[tuple[float, float], ...]:
    """Per-layer (k_scale, v_scale): given in the config, calibrated for an FP8 cache, else all 1.0."""
    num_layers = model.config.num_layers
    if engine_config.kv_cache_dtype != "fp8":
        return ((1.0, 1.0),) * num_layers
    if engine_config.kv_scales is not None:
        if len(engine_config.kv_scales) != num_layers:
            raise ValueError(
                f"kv_scales has {len(engine_config.kv_scales)} (k, v) pairs; the model has {num_layers} layers"
            )
        return tuple((float(k), float(v)) for k, v in engine_config.kv_scales)
    tokens = calibration_token_ids(getattr(weights, "model_dir", None), model.config.vocab_size)
    return calibrate_kv_scales(model, tokens, TORCH_DTYPES[engine_config.dtype], engine_config.block_size)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (weights, scales, the rope table)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    extra = [t for t in vars(model).values() if isinstance(t, torch.Tensor)]  # e.g. cos_sin_cache
    tensors.update({id(t): t for t in extra})
    return sum(t.numel() * t.element_size() for t in tensors.values())
