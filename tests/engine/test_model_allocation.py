"""workers.engine.loader.allocate_empty against torch's Module.to_empty, on every model class the
engine builds: the same parameters and buffers (names, shapes, dtypes, device, Parameter or not),
the same state_dict keys (persistent buffers stay persistent), and no storage shared between two
tensors that to_empty keeps apart."""

from __future__ import annotations

import pytest
import torch

from kernels.ops import kernel_ops
from tests.engine.helpers import save_tiny_model
from workers.engine.loader import allocate_empty
from workers.models.config import ModelConfig
from workers.models.registry import MODEL_CLASSES

FAMILIES = ["llama", "qwen3", "gemma3", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_allocate_empty_gives_what_to_empty_gives(family):
    folder, _ = save_tiny_model(family)
    config = ModelConfig.from_model_dir(folder)
    model_class = MODEL_CLASSES[config.architecture]
    ops = kernel_ops("reference", torch.device("cpu"))
    built = []
    for materialize in (lambda m: m.to_empty(device="cpu"), lambda m: allocate_empty(m, "cpu")):
        with torch.device("meta"):
            model = model_class(config, ops)
        built.append(materialize(model))
    reference, ours = built

    def described(model):
        tensors = [("param", n, p) for n, p in model.named_parameters(remove_duplicate=False)]
        tensors += [("buffer", n, b) for n, b in model.named_buffers(remove_duplicate=False)]
        return [
            (kind, name, tuple(t.shape), t.dtype, t.device.type, type(t), t.requires_grad) for kind, name, t in tensors
        ]

    assert described(ours) == described(reference)
    assert list(ours.state_dict()) == list(reference.state_dict())
    pointers = [t.data_ptr() for _, t in ours.named_parameters(remove_duplicate=False) if t.numel()]
    assert len(set(pointers)) == len(pointers)
