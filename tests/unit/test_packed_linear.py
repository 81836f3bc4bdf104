"""Prepacked linear layers (oneDNN, and kernels/small_m_linear for float32 weights with a multiple
of 16 outputs): same products as F.linear, swapped in for plain nn.Linear only."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kernels import small_m_linear
from tests.engine.helpers import save_tiny_model
from workers.config import EngineConfig
from workers.engine.loader import load_model
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.quantization import packed_linear
from workers.quantization.fp8 import Fp8Linear, weight_memory

if not packed_linear.available(torch.zeros(2, 2)):
    pytest.skip("oneDNN prepacking is not available in this torch build", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [200, 192])  # 192 in float32: the native small-M kernel
def test_packed_linear_matches_f_linear(dtype, rows, bias, out_features):
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, out_features, bias=bias).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    expected = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    module = packed_linear.PackedLinear(linear)
    native = dtype == torch.float32 and out_features % 16 == 0 and small_m_linear.native_built()
    assert module.packed_weight.dim() == (3 if native else 2)
    out = module(x)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(out.double(), expected, **tol)
    reference = F.linear(x, linear.weight, linear.bias)  # what the model computed before packing
    torch.testing.assert_close(
        out, reference, **({"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.016})
    )


def test_non_contiguous_input():
    linear = nn.Linear(64, 32)
    x = torch.randn(10, 128)[:, ::2]
    torch.testing.assert_close(
        packed_linear.PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5
    )


def test_prepack_swaps_plain_linears_only_and_packs_the_lm_head():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8, bias=False))
            self.fp8 = Fp8Linear(8, 8, bias=False)
            self.lm_head_weight = torch.randn(20, 8)

    toy = Toy()
    weight = toy.block[0].weight
    assert packed_linear.prepack(toy) == 2
    assert isinstance(toy.block[0], packed_linear.PackedLinear) and isinstance(toy.block[2], packed_linear.PackedLinear)
    assert toy.block[0].weight is weight  # the parameter is kept for tools that read it
    assert isinstance(toy.fp8, Fp8Linear)
    assert toy.packed_lm_head is not None
    x = torch.randn(3, 8)
    torch.testing.assert_close(
        packed_linear.packed_linear(x, toy.packed_lm_head, None), x @ toy.lm_head_weight.T, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("packed,backend", [(True, "auto"), (False, "reference")])
def test_engine_config_switches_prepacking_and_kernels(packed, backend):
    folder, _ = save_tiny_model("llama")
    config = EngineConfig(packed_linear=packed, kernel_backend=backend)
    model = load_model(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
    layers = [type(m) for m in model.modules() if isinstance(m, (nn.Linear, packed_linear.PackedLinear))]
    assert layers and set(layers) == {packed_linear.PackedLinear if packed else nn.Linear}
    assert (model.packed_lm_head is not None) == packed
    # Every layer calls the kernels resolved once for the model.
    assert model.ops.backend == ("native" if backend == "auto" else "reference")
    assert all(layer.ops is model.ops and layer.self_attn.ops is model.ops for layer in model.layers)


def test_weight_memory_counts_packed_layers_as_linear_layers():
    # bench/fp8_accuracy.py reports the linear layers' bytes per dtype from weight_memory().
    model = nn.Sequential(nn.Embedding(10, 32), nn.Linear(32, 64), nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    before = weight_memory(model)
    assert before.linear_bytes == (32 * 64 + 64 + 64 * 32) * 2 and before.other_bytes == 10 * 32 * 2
    assert packed_linear.prepack(model) == 2
    assert weight_memory(model) == before
