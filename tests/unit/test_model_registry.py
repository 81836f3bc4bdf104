"""The model registry (workers/models/registry.py): every registered family's architectures resolve to
its class and config hook, an unknown architecture is refused naming the supported ones, and a family
registered here (a toy, removed after) is found by every lookup the product makes: the folder check,
config.json's reading, the loader's class and its tensor-parallel check. The oracle is the registry's
own contents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.loader import load_model
from workers.models import registry
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.family import FULL, SLIDING, ModelFamily, WindowRule
from workers.models.files import ModelNotFoundError, check_model_dir
from workers.models.llama import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
ARCHS = [(f, a) for f in registry.families() for a in f.architectures]


def config_json(arch: str, family: ModelFamily, **extra) -> dict:
    """A config.json every family's hook reads (the MoE fields are ignored by dense families)."""
    return {
        "architectures": [arch],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": family.activations[0],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 256,
        **extra,
    }


@pytest.mark.parametrize("family,arch", ARCHS, ids=[a for _, a in ARCHS])
def test_each_architecture_resolves_to_its_family_class_and_config_hook(family, arch):
    assert registry.family_for(arch) is family
    module, _, name = family.model_class.partition(":")
    cls = registry.model_class(arch)
    assert (cls.__module__, cls.__name__) == (module, name)
    assert issubclass(cls, torch.nn.Module) and registry.MODEL_CLASSES[arch] is cls
    config = config_json(arch, family)
    parsed = ModelConfig.from_dict(config)
    assert parsed.architecture == arch and parsed.hidden_act == family.activations[0]
    for field, value in family.config_fields(arch, config).items():
        assert getattr(parsed, field) == value, field
    assert (parsed.num_experts > 0) == family.moe


@pytest.mark.parametrize("family,arch", ARCHS, ids=[a for _, a in ARCHS])
def test_each_family_slides_the_layers_its_rule_names(family, arch):
    config = config_json(arch, family, sliding_window=16, use_sliding_window=True, max_window_layers=2)
    config.update(sliding_window_pattern=2)
    want = tuple(16 if t == SLIDING else None for t in family.window_rule.layer_types(config))
    assert ModelConfig.from_dict(config).layer_windows == (want if any(want) else ())
    # layer_types, where config.json has it, wins over every family's rule.
    types = [FULL, SLIDING, FULL, SLIDING]
    assert ModelConfig.from_dict({**config, "layer_types": types}).layer_windows == (None, 16, None, 16)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    supported = registry.supported_architectures()
    assert supported == tuple(a for _, a in ARCHS)
    listing = ", ".join(supported)
    with pytest.raises(registry.UnsupportedArchitecture, match="'GPTNeoXForCausalLM' not supported") as e:
        registry.family_for("GPTNeoXForCausalLM")
    assert listing in str(e.value)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict({"architectures": ["GPTNeoXForCausalLM"]})
    assert "GPTNeoXForCausalLM" in str(e.value) and listing in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelNotFoundError) as e:
        check_model_dir(tmp_path)
    assert listing in str(e.value)


def test_a_family_is_registered_once():
    llama = registry.family_for("LlamaForCausalLM")
    with pytest.raises(ValueError, match="registered already"):
        registry.register_family(llama)
    with pytest.raises(ValueError, match="already belong to 'Llama'"):
        registry.register_family(ModelFamily("Other", ("LlamaForCausalLM",), llama.model_class))
    with pytest.raises(ValueError, match="module:Class"):
        ModelFamily("Broken", ("BrokenForCausalLM",), "no_class_named")


def test_the_registry_lists_architectures_without_torch():
    code = (
        "import sys\nfrom workers.models import registry\nfrom workers.models.files import check_model_dir\n"
        "assert registry.supported_architectures()\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- a toy family: one module's worth of declarations plus one registration -------------------------


class ToyForCausalLM(LlamaForCausalLM):
    """The toy family's class: Llama's, under a name of its own."""


def _toy_fields(arch: str, config: dict) -> dict:
    return {"qkv_bias": False, "rms_norm_eps": float(config["toy_eps"])}


TOY = ModelFamily(
    "Toy",
    ("ToyForCausalLM",),
    f"{__name__}:ToyForCausalLM",
    config_fields=_toy_fields,
    window_rule=WindowRule("the last layer", lambda c: [FULL] * (c["num_hidden_layers"] - 1) + [SLIDING]),
    tensor_parallel=False,
)


@pytest.fixture
def toy_family():
    registry.register_family(TOY)
    try:
        yield TOY
    finally:
        registry.unregister_family(TOY.name)
    assert "ToyForCausalLM" not in registry.supported_architectures()


@pytest.fixture(scope="module")
def tiny_llama():
    from tests.engine.helpers import save_tiny_model

    folder, _ = save_tiny_model("llama")
    return folder


def test_a_registered_family_is_found_by_every_lookup_the_product_makes(toy_family, tiny_llama, tmp_path):
    for f in Path(tiny_llama).iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    config = json.loads((Path(tiny_llama) / "config.json").read_text())
    config.update(architectures=["ToyForCausalLM"], toy_eps=1e-3, sliding_window=8)
    (tmp_path / "config.json").write_text(json.dumps(config))

    assert "ToyForCausalLM" in registry.supported_architectures()
    assert check_model_dir(tmp_path)["architectures"] == ["ToyForCausalLM"]  # files.py's check
    parsed = ModelConfig.from_model_dir(tmp_path)  # its config hook and its window rule
    assert (parsed.architecture, parsed.rms_norm_eps, parsed.layer_windows) == ("ToyForCausalLM", 1e-3, (None, 8))
    model = load_model(parsed, EngineConfig(), iter_safetensors(tmp_path))  # its class
    assert type(model) is ToyForCausalLM
    with pytest.raises(ValueError, match="tensor parallelism does not support the Toy family"):
        load_model(parsed, EngineConfig(), iter_safetensors(tmp_path), tp_group=object())
