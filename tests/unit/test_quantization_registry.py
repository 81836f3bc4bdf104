"""The quantization registry (workers/quantization/registry.py): the configuration's names and the
checkpoint formats come from it, an unknown name is refused naming the field and the known methods,
FP8 is a method by the explicit protocol (and its MoE experts by an explicit base class, not a probed
name), and a method registered here (removed after) is the one the loader runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from workers.config import QUANTIZATIONS, EngineConfig, SpeculativeConfig
from workers.engine.loader import load_model
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.moe import MoeExperts
from workers.quantization import fp8
from workers.quantization import registry as q

REPO = Path(__file__).resolve().parents[2]


def test_the_configuration_takes_the_registered_names():
    assert QUANTIZATIONS == (None, *q.quantization_names())
    for name in QUANTIZATIONS:
        assert EngineConfig(quantization=name).quantization == name
    assert EngineConfig.__dataclass_fields__["quantization"].metadata["help"] == q.quantization_help()


def test_an_unknown_method_is_refused_naming_the_field_and_the_known_ones():
    for make, field in (
        (lambda: EngineConfig(quantization="int8"), "quantization"),
        (lambda: q.quantization_method("int8"), "quantization"),
        (
            lambda: SpeculativeConfig.from_json(
                '{"method": "draft_model", "num_speculative_tokens": 2, "model": "/m", "quantization": "int8"}'
            ),
            "speculative_config.quantization",
        ),
    ):
        with pytest.raises(ValueError, match=f"^{field} must be null or") as e:
            make()
        assert "'int8'" in str(e.value) and all(repr(n) in str(e.value) for n in q.quantization_names())
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported") as e:
        q.checkpoint_quantization({"quant_method": "gptq"})
    assert all(f in str(e.value) for f in q.checkpoint_formats_known())


def test_fp8_is_a_method_by_the_protocol_and_reads_its_checkpoint_formats():
    method = q.quantization_method("fp8")
    assert method is fp8.FP8 and isinstance(method, q.QuantizationMethod)
    assert q.checkpoint_formats_known() == fp8.CHECKPOINT_METHODS
    found = q.checkpoint_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert (found.name, found.method) == ("fp8", fp8.FP8)
    assert found.scheme == fp8.CheckpointQuantization("fp8", "block", 128, 128)
    assert q.checkpoint_quantization(None) is None and q.checkpoint_quantization({}) is None
    # Modules with FP8 weights of their own say so by their class: the method does not probe names.
    assert issubclass(MoeExperts, fp8.Fp8Weights) and not issubclass(nn.Linear, fp8.Fp8Weights)


def test_the_names_are_read_without_torch():
    code = "import sys\nimport workers.config\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class ToyMethod:
    """A method that records what the loader asks of it (linear layers left as they are)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def parse_checkpoint(self, quantization_config: dict) -> dict:
        self.calls.append("parse")
        return quantization_config

    def prepare_checkpoint(self, model, scheme, ops=None) -> int:
        self.calls.append("prepare")
        return 0

    def quantize(self, model, ops=None) -> int:
        self.calls.append("quantize")
        return sum(isinstance(m, nn.Linear) for m in model.modules())

    def cast(self, model, dtype):
        return fp8.cast_model(model, dtype)

    def weight_memory(self, model):
        return fp8.weight_memory(model)


@pytest.fixture
def toy_method():
    method = ToyMethod()
    q.register_quantization("toy", method, checkpoint_formats=("toy-ckpt",), help="a test's method")
    try:
        yield method
    finally:
        q.unregister_quantization("toy")
    with pytest.raises(ValueError, match="quantization must be null or"):
        EngineConfig(quantization="toy")


def test_a_registered_method_is_the_one_the_loader_runs(toy_method):
    from tests.engine.helpers import save_tiny_model

    folder, _ = save_tiny_model("llama")
    config = EngineConfig(quantization="toy")  # accepted while registered
    assert "toy: a test's method" in q.quantization_help()
    load_model(ModelConfig.from_model_dir(folder), config, iter_safetensors(folder))
    assert toy_method.calls == ["quantize"]
    scheme = q.checkpoint_quantization({"quant_method": "toy-ckpt", "bits": 3})
    assert (scheme.name, scheme.method, scheme.scheme["bits"]) == ("toy", toy_method, 3)
    with pytest.raises(ValueError, match="registered already"):
        q.register_quantization("toy", toy_method)
    with pytest.raises(ValueError, match="read by another"):
        q.register_quantization("toy2", toy_method, checkpoint_formats=("fp8",))
