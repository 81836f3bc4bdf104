"""FP8 weights (`--quantization fp8`) for the mixture-of-experts and Gemma families.

Oracle: transformers on the same tiny model with every weight the engine quantizes replaced by
its FP8 round trip, computed here by hand (one scale per output row: amax / 448, cast to e4m3 and
back; the experts per expert and row, the MoE router left in float as the engine leaves it), so a
bug in workers.quantization or in the experts' dequantization cannot hide in its own oracle. The
engine's greedy tokens must equal that model's and its logits agree within 2e-5; with the experts
split over 2 ranks (by channel or whole) the tokens equal TP 1's.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.engine.helpers import compare_greedy, hf_greedy, run_with_logits, save_tiny_model
from workers.build import load_engine
from workers.config import EngineConfig
from workers.models.moe import MoeExperts

pytestmark = pytest.mark.slow
NEW_TOKENS = 10
FP8 = torch.float8_e4m3fn
FAMILIES = {
    "mixtral": ("mixtral", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", dict(tie_word_embeddings=False, mlp_only_layers=[1])),
    "gemma3": ("gemma3", dict(sliding_window=16)),
}


def round_trip_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row of w's last dimension through e4m3 with the scale amax / 448, back in w's dtype."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return ((w32 / scale).clamp(-448.0, 448.0).to(FP8).float() * scale).to(w.dtype)


def fp8_oracle(hf: torch.nn.Module) -> torch.nn.Module:
    """hf with its decoder projections and experts (not the router, embeddings or lm_head) FP8 round-tripped."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            projection = name.endswith("_proj.weight") and ".layers." in name
            experts = ".experts." in name and param.dim() == 3
            if projection or experts:
                param.copy_(round_trip_rows(param))
    return hf


def assert_matches(engine, oracle, prompts, what: str) -> None:
    """Greedy tokens equal the oracle's, logits within 2e-5: the same arithmetic in another order
    (measured about 1e-6; a 0.4% error in one expert scale moves these logits by 2e-4 to 4e-4)."""
    completions, logits = run_with_logits(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    with torch.inference_mode():
        for prompt, done, rows in zip(prompts, completions, logits):
            result = compare_greedy(done.token_ids, hf_greedy(oracle, prompt, NEW_TOKENS), rows)
            assert result.max_logit_error < 2e-5, f"{what}: logits differ by {result.max_logit_error:.2e}"


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 40)]  # 40: past Gemma 3's window of 16


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp8_weights_match_transformers_on_round_tripped_weights(family, prompts):
    kind, overrides = FAMILIES[family]
    folder, hf = save_tiny_model(kind, **overrides)
    oracle = fp8_oracle(hf)
    oracle.generation_config.eos_token_id = None
    engine = load_engine(folder, EngineConfig(num_kv_blocks=64, quantization="fp8"))
    experts = [m for m in engine.runner.model.modules() if isinstance(m, MoeExperts)]
    assert all(e.w13.dtype == FP8 and e.w2.dtype == FP8 for e in experts) and (experts or family == "gemma3")
    assert_matches(engine, oracle, prompts, family)


def test_fp8_experts_split_over_two_ranks_match_one(prompts):
    from testkit.tensor_parallel import GroupJob, run_group

    folder, _ = save_tiny_model("mixtral", tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=4)
    config = EngineConfig(num_kv_blocks=64, quantization="fp8")
    one = load_engine(folder, config)
    want = [
        c.token_ids
        for c in one.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    ]
    for expert_parallel in (False, True):
        [result] = run_group(
            [GroupJob(folder, prompts, NEW_TOKENS)],
            2,
            EngineConfig(num_kv_blocks=64, quantization="fp8", enable_expert_parallel=expert_parallel),
        )
        assert result.token_ids == want, f"expert_parallel={expert_parallel}"


@pytest.mark.parametrize(
    "kind, fmt", [("qwen3_moe", "fp8-block"), ("qwen3_moe", "ct-channel"), ("gemma3", "ct-channel")]
)
def test_a_prequantized_checkpoint_loads_its_dequantized_weights(kind, fmt, prompts, tmp_path):
    """A Qwen3-MoE checkpoint with FP8 attention, dense MLP and per-expert weights (block scales as
    Qwen3-*-FP8 publishes, or compressed-tensors per channel; the router in float), and a Gemma 3
    one in compressed-tensors (as FP8 Gemma checkpoints are published): the engine computes with
    exactly the weights the hand dequantization gives, as transformers does on a float checkpoint
    of those weights."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.fp8.helpers import write_fp8_checkpoint

    kind_overrides = dict(tie_word_embeddings=False, mlp_only_layers=[1]) if kind == "qwen3_moe" else FAMILIES[kind][1]
    folder, _ = save_tiny_model(kind, **kind_overrides)
    quantized = tmp_path / "fp8"
    dequantized = write_fp8_checkpoint(folder, str(quantized), fmt)
    assert not any("mlp.gate.weight" in n for n in dequantized)
    assert kind != "qwen3_moe" or any(".experts.3.down_proj." in n for n in dequantized)
    # The oracle: the same checkpoint in float, each quantized tensor replaced by its hand dequantization.
    from safetensors.torch import load_file

    state = {
        n: t
        for f in sorted(quantized.glob("*.safetensors"))
        for n, t in load_file(str(f)).items()
        if not n.endswith(("_scale", "_scale_inv"))
    }
    state.update(dequantized)
    plain = tmp_path / "dequantized"
    plain.mkdir()
    save_file(
        {n: t.float().contiguous() for n, t in state.items()},
        str(plain / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    oracle = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    oracle.generation_config.eos_token_id = None

    engine = load_engine(quantized, EngineConfig(num_kv_blocks=64))
    experts = [m for m in engine.runner.model.modules() if isinstance(m, MoeExperts)]
    assert all(e.w13.dtype == FP8 for e in experts) and (experts or kind == "gemma3")
    assert_matches(engine, oracle, prompts, f"{kind} {fmt}")
