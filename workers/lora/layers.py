"""The model's projections with each row's adapter update added after the base product.

`attach_lora(model, manager)` wraps every layer's qkv_proj, o_proj, gate_up_proj and down_proj.
The fused projections hold several of PEFT's targets side by side (q | k | v, gate | up), so each
target adds into its own column range of the fused output. Which adapter a row runs under is the
manager's `row_slots`, set by the model runner for each step; None (no adapter in the step) leaves
the base product untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora import lora_add_
from workers.lora.adapter import target_shape
from workers.lora.manager import LoRAManager
from workers.models.llama import LlamaForCausalLM

__all__ = ["LoRAProjection", "attach_lora"]


class LoRAProjection(nn.Module):
    def __init__(self, base: nn.Module, manager: LoRAManager, layer: int, targets: tuple[str, ...]) -> None:
        super().__init__()
        self.base = base
        self.manager = manager
        self.layer = layer
        # (target, first output column, columns) within the base projection's output
        self.parts: list[tuple[str, int, int]] = []
        offset = 0
        for target in targets:
            width = target_shape(manager.config, target)[1]
            self.parts.append((target, offset, width))
            offset += width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.manager.row_slots
        if rows is None:
            return y
        m = self.manager
        xa = x if x.dtype == m.dtype else x.to(m.dtype)
        ya = y if y.dtype == m.dtype else y.to(m.dtype)
        for target, offset, width in self.parts:
            if target not in m.active_targets:
                continue  # no adapter of this step adapts it: its matrices are zeros
            key = (self.layer, target)
            lora_add_(ya[:, offset : offset + width], xa, m.a[key], m.b[key], rows, m.scaling)
        return ya if ya is y else ya.to(y.dtype)


def attach_lora(model: LlamaForCausalLM, manager: LoRAManager) -> None:
    """Wrap the projections of every decoder layer of `model` (the Llama family's layout)."""
    wrapped = (
        ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("self_attn", "o_proj", ("o_proj",)),
        ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
        ("mlp", "down_proj", ("down_proj",)),
    )
    for i, layer in enumerate(model.layers):
        for block_name, name, targets in wrapped:
            block = layer.get_submodule(block_name)
            setattr(block, name, LoRAProjection(block.get_submodule(name), manager, i, targets))
