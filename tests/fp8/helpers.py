"""Independent oracles for FP8 tests: checkpoint writers and hand dequantization, written without
workers.quantization so that a bug there cannot hide in its own test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in LINEARS and parts[-1] == "weight"


def quantize_blocks(w: torch.Tensor, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 with one scale per tile, loops and all (slow is fine: tiny weights)."""
    n, k = w.shape
    rb, cb = math.ceil(n / block_rows), math.ceil(k / block_cols)
    scales = torch.empty(rb, cb)
    q = torch.empty(n, k, dtype=FP8)
    for i in range(rb):
        for j in range(cb):
            tile = w[i * block_rows : (i + 1) * block_rows, j * block_cols : (j + 1) * block_cols].float()
            s = max(float(tile.abs().max()), 1e-8) / 448.0
            scales[i, j] = s
            q[i * block_rows : (i + 1) * block_rows, j * block_cols : (j + 1) * block_cols] = (tile / s).to(FP8)
    return q, scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows = slice(i * block_rows, (i + 1) * block_rows)
            cols = slice(j * block_cols, (j + 1) * block_cols)
            out[rows, cols] = q[rows, cols].float() * scales[i, j]
    return out


def write_fp8_checkpoint(src_dir: str, dst_dir: str, fmt: str) -> dict[str, torch.Tensor]:
    """Quantize a float HF folder's linear weights into an FP8 checkpoint of the given format.

    fmt: "fp8-block" (quant_method fp8, 32x48 blocks so tiles are ragged at the edges,
    weight_scale_inv), "ct-channel" / "ct-tensor" (compressed-tensors float-quantized, weight_scale).
    Returns the hand-dequantized float weights by name: what the loaded model must compute with.
    """
    from safetensors.torch import load_file

    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out, dequantized = {}, {}
    for name, w in state.items():
        if not is_linear_weight(name):
            out[name] = w
            continue
        if fmt == "fp8-block":
            q, s = quantize_blocks(w, 32, 48)
            out[name], out[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize_blocks(q, s, 32, 48)
        elif fmt == "ct-channel":
            s = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-8)
            q = (w.float() / s).to(FP8)
            out[name], out[name + "_scale"] = q, s
            dequantized[name] = q.float() * s
        elif fmt == "ct-tensor":
            s = (w.float().abs().max() / 448.0).reshape(1)
            q = (w.float() / s).to(FP8)
            out[name], out[name + "_scale"] = q, s
            dequantized[name] = q.float() * s
        else:
            raise ValueError(fmt)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [32, 48],
        }
    else:
        strategy = fmt.removeprefix("ct-")
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                    },
                }
            },
        }
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]
