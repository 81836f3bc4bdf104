"""Tensor parallelism, phase 1 (workers/parallel/sharding.py): sharded engines in lockstep are exact.

Oracles: hand-computed head and channel ranges for ShardPlan; for the sharded engines, float32
greedy tokens of the same engine at TP 1 and of transformers. Every rank must produce the same
tokens (they all sample from the same all-reduced hidden states). The rank processes are spawned
with a gloo group on 127.0.0.1, one torch thread each.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from common.sampling_params import SamplingParams
from testkit.tensor_parallel import GroupJob, build_tp_engine, run_group
from tests.engine.helpers import LOGIT_TOL, hf_greedy, run_with_logits, save_tiny_model
from workers.config import EngineConfig
from workers.models.config import ModelConfig
from workers.parallel.group import TPGroup
from workers.parallel.sharding import ShardedCheckpoint, ShardPlan

NEW_TOKENS = 12
MIGRATE_AFTER = 5  # tokens a TP-1 worker produced before its request moved to a group
CONFIG = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64)


def model_config(heads: int, kv_heads: int, intermediate: int, head_dim: int = 8, **extra) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": heads * head_dim,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            **extra,
        }
    )


# ---- ShardPlan and ShardedCheckpoint (fast) ---------------------------------------------------


def test_plan_of_smollm_shape_at_tp3():
    cfg = model_config(9, 3, 1536, head_dim=64)  # SmolLM2-135M's attention and MLP shape
    plans = [ShardPlan.of(cfg, 3, r) for r in range(3)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.intermediate for p in plans] == [(0, 512), (512, 1024), (1024, 1536)]
    assert plans[1].q_rows == slice(192, 384) and plans[1].kv_rows == slice(64, 128)
    shard = plans[2].model_config
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.head_dim) == (3, 1, 512, 64)
    assert shard.hidden_size == cfg.hidden_size and not plans[0].kv_replicated


def test_plan_replicates_kv_heads_when_tp_exceeds_them():
    cfg = model_config(8, 2, 160)
    plans = [ShardPlan.of(cfg, 4, r) for r in range(4)]
    # Query heads 0-3 read KV head 0 and 4-7 read KV head 1 (groups of 4): each rank keeps its group's head.
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(p.kv_replicated and p.model_config.num_kv_heads == 1 for p in plans)
    assert [ShardPlan.of(cfg, 2, r).kv_heads for r in range(2)] == [(0, 1), (1, 2)]
    assert ShardPlan.of(model_config(8, 4, 160), 4, 3).kv_heads == (3, 4)
    assert ShardPlan.of(cfg, 1, 0).model_config == cfg


@pytest.mark.parametrize(
    "heads, kv, inter, tp, message",
    [
        (9, 3, 1536, 2, "tensor_parallel_size 2 does not divide the model's 9 query heads"),
        (8, 4, 150, 4, "tensor_parallel_size 4 does not divide the model's intermediate_size 150"),
        (12, 4, 120, 3, "tensor_parallel_size 3 does not divide the model's 4 KV heads"),
        (6, 2, 120, 3, "tensor_parallel_size 3 exceeds the model's 2 KV heads and is not a multiple"),
        (8, 4, 160, 0, "need tensor_parallel_size >= 1"),
    ],
)
def test_plan_refuses_uneven_splits(heads, kv, inter, tp, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan.of(model_config(heads, kv, inter), tp, 0)


def moe_config(experts: int = 8, moe_inter: int = 48) -> ModelConfig:
    return dataclasses.replace(
        model_config(8, 4, 160),
        architecture="MixtralForCausalLM",
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
    )


def test_plan_splits_experts_whole_or_by_their_channels():
    cfg = moe_config()
    by_channel = [ShardPlan.of(cfg, 4, r) for r in range(4)]
    assert [p.moe_intermediate for p in by_channel] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    assert all(p.experts == (0, 8) and p.model_config.moe_intermediate_size == 12 for p in by_channel)
    assert by_channel[0].model_config.local_experts is None and by_channel[0].model_config.num_experts == 8
    whole = [ShardPlan.of(cfg, 4, r, expert_parallel=True) for r in range(4)]
    assert [p.experts for p in whole] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # The router still scores all 8 experts on every rank; each holds two of them, every channel.
    assert [p.model_config.local_experts for p in whole] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(p.model_config.num_experts == 8 and p.model_config.moe_intermediate_size == 48 for p in whole)
    assert ShardPlan.of(cfg, 1, 0, expert_parallel=True).model_config.local_experts is None
    with pytest.raises(
        ValueError, match="--enable-expert-parallel: tensor_parallel_size 3 does not divide the model's 8 experts"
    ):
        ShardPlan.of(dataclasses.replace(cfg, num_heads=6, num_kv_heads=3), 3, 0, True)
    with pytest.raises(ValueError, match="does not divide the experts' intermediate size 50"):
        ShardPlan.of(moe_config(8, 50), 4, 0)


def test_expert_tensors_are_cut_per_rank():
    cfg = moe_config(experts=4, moe_inter=4)
    gate_up = torch.arange(4 * 8 * 2, dtype=torch.float32).reshape(4, 8, 2)  # [E, gate rows 0-3 then up rows 4-7, H]
    down = torch.arange(4 * 2 * 4, dtype=torch.float32).reshape(4, 2, 4)  # [E, H, I]
    w1 = torch.arange(8.0).reshape(4, 2)  # one expert's gate [I, H]
    w2 = torch.arange(8.0).reshape(2, 4)  # one expert's down [H, I]
    pre = "model.layers.0.block_sparse_moe.experts."

    def cut(plan, name, tensor):
        return ShardedCheckpoint([], cfg, plan).expert(name, tensor)

    channel = ShardPlan.of(cfg, 2, 1)  # channels 2-3 of every expert
    assert torch.equal(cut(channel, pre + "3.w1.weight", w1)[1], w1[2:4])
    assert torch.equal(cut(channel, pre + "3.w2.weight", w2)[1], w2[:, 2:4])
    name, fused = cut(channel, "model.layers.0.mlp.experts.gate_up_proj", gate_up)
    assert torch.equal(fused, torch.cat((gate_up[:, 2:4], gate_up[:, 6:8]), dim=1))
    assert torch.equal(cut(channel, "model.layers.0.mlp.experts.down_proj", down)[1], down[:, :, 2:4])
    whole = ShardPlan.of(cfg, 2, 1, expert_parallel=True)  # experts 2 and 3, renumbered 0 and 1
    assert cut(whole, pre + "1.w1.weight", w1) is None
    assert cut(whole, pre + "3.w3.weight", w1) == (pre + "1.w3.weight", w1)
    assert torch.equal(cut(whole, "model.layers.0.mlp.experts.down_proj", down)[1], down[2:4])


def test_checkpoint_slices_columns_rows_and_biases():
    cfg = model_config(4, 2, 6, head_dim=2)  # hidden 8; q rows 8, k/v rows 4
    plan = ShardPlan.of(cfg, 2, 1)
    full = torch.arange(64.0).reshape(8, 8)
    shard = ShardedCheckpoint([], cfg, plan).shard
    pre = "model.layers.0."
    assert torch.equal(shard(pre + "self_attn.q_proj.weight", full), full[4:8])
    assert torch.equal(shard(pre + "self_attn.k_proj.bias", torch.arange(4.0)), torch.tensor([2.0, 3.0]))
    assert torch.equal(shard(pre + "self_attn.o_proj.weight", full), full[:, 4:8])
    assert torch.equal(shard(pre + "mlp.down_proj.weight", full[:, :6]), full[:, 3:6])
    assert torch.equal(shard(pre + "mlp.up_proj.weight", full[:6]), full[3:6])
    # Row-parallel biases live on rank 0 only, so the all-reduce adds them once.
    assert torch.equal(shard(pre + "mlp.down_proj.bias", torch.ones(8)), torch.zeros(8))
    assert torch.equal(
        ShardedCheckpoint([], cfg, ShardPlan.of(cfg, 2, 0)).shard(pre + "mlp.down_proj.bias", torch.ones(8)),
        torch.ones(8),
    )
    # Phi-3's fused [q; k; v] (8 + 4 + 4 rows): the rank's q rows 4:8, k rows 10:12, v rows 14:16.
    fused = torch.arange(16.0)[:, None].expand(16, 3)
    assert shard(pre + "self_attn.qkv_proj.weight", fused)[:, 0].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert shard(pre + "mlp.gate_up_proj.weight", torch.arange(12.0)[:, None])[:, 0].tolist() == [3, 4, 5, 9, 10, 11]
    # Per-channel FP8 scales follow their rows; per-head-dim norms, embeddings and per-tensor scales stay whole.
    assert shard(pre + "self_attn.v_proj.weight_scale", torch.arange(4.0)[:, None]).flatten().tolist() == [2, 3]
    assert torch.equal(shard(pre + "self_attn.o_proj.weight_scale", torch.arange(8.0)), torch.arange(8.0))
    for name, tensor in (
        (pre + "self_attn.q_norm.weight", torch.arange(2.0)),
        ("model.embed_tokens.weight", full),
        (pre + "self_attn.q_proj.weight_scale", torch.tensor(0.5)),
    ):
        assert torch.equal(shard(name, tensor), tensor)


def test_group_of_one_needs_no_collectives():
    group = TPGroup.single()
    x = torch.ones(3)
    assert group.all_reduce(x) is x and (group.rank, group.size) == (0, 1)
    with pytest.raises(ValueError, match="TP rank 2 is outside a group of size 2"):
        TPGroup(2, 2)


# ---- a sharded engine: rank 0 schedules and broadcasts each step (slow) ----------------------


@dataclass
class Oracle:
    tp1: list[list[int]]  # the engine's greedy tokens at TP 1, per prompt
    tp1_logits: list[torch.Tensor]  # [tokens, vocab] per prompt
    hf: list[list[int]]  # transformers' greedy tokens


def oracle(folder: str, hf, prompts: list[list[int]]) -> Oracle:
    engine = build_tp_engine(folder, CONFIG, TPGroup.single())
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    completions, logits = run_with_logits(engine, prompts, greedy)
    hf.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    with torch.inference_mode():
        ref = [hf_greedy(hf, p, NEW_TOKENS).token_ids for p in prompts]
    return Oracle([c.token_ids for c in completions], [torch.stack(rows) for rows in logits], ref)


def assert_exact(result, expected: Oracle, what: str) -> None:
    """Tokens identical to TP 1 and to transformers; logits within LOGIT_TOL of TP 1's (a bias added
    on every rank, or a wrong KV head, moves them far more); every rank ran every step of rank 0."""
    assert expected.tp1 == expected.hf, f"{what}: TP 1 differs from transformers"
    tp = len(result.steps_run)
    assert result.token_ids == expected.tp1, f"{what}: TP {tp} differs from TP 1"
    for ours, tp1 in zip(result.logits, expected.tp1_logits):
        error = float((ours - tp1).abs().max())
        assert error < LOGIT_TOL, f"{what}: TP {tp} logits differ from TP 1 by {error:.2e}"
    assert result.steps_run[0] > 0 and len(set(result.steps_run)) == 1, f"{what}: steps per rank {result.steps_run}"


# 8 query heads, 4 KV heads (2 in "llama-2kv", replicated at TP 4); Llama with o_proj and MLP
# biases (row-parallel biases added once), Qwen2's q/k/v biases, Qwen3's q/k norms, Phi-3's fused weights.
TINY = {
    "llama-bias": (
        "llama",
        dict(
            num_attention_heads=8, num_key_value_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=False
        ),
    ),
    "qwen2": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)),
    "phi3": ("phi3", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-2kv": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
}
AT_TP = {2: ["llama-bias", "qwen2", "qwen3", "phi3"], 4: ["llama-bias", "qwen2", "llama-2kv"]}


@pytest.fixture(scope="module")
def tiny_models():
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 21)]  # one prompt spans two blocks
    models = {}
    for name, (kind, overrides) in {**TINY, **TINY_MOE}.items():
        folder, hf = save_tiny_model(kind, **overrides)
        models[name] = (folder, oracle(folder, hf, prompts))
    return prompts, models


# 8 experts, top-2; Qwen3-MoE with a dense MLP in layer 1 (mlp_only_layers), split as a dense model's.
TINY_MOE = {
    "mixtral": ("mixtral", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            mlp_only_layers=[1],
        ),
    ),
}


# One group of processes per case: the dense models where the case's size applies, and both MoE
# models with the experts split by channel or whole (expert parallel).
@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, expert_parallel",
    [(2, False), (2, True), (4, True)],
    ids=["tp2-expert-channels", "tp2-expert-parallel", "tp4-expert-parallel"],
)
def test_tiny_models_match_tp1_and_transformers(tiny_models, tp, expert_parallel):
    prompts, models = tiny_models
    names = [*(AT_TP[tp] if not (tp == 2 and expert_parallel) else []), *TINY_MOE]
    jobs = [GroupJob(models[name][0], prompts, NEW_TOKENS, record_logits=True) for name in names]
    # A migration onto this group: the TP-1 engine's first tokens of each prompt, continued here.
    folder, expected = models["llama-bias"]
    migrated = GroupJob(folder, prompts, NEW_TOKENS, resume_from=[tokens[:MIGRATE_AFTER] for tokens in expected.tp1])
    config = dataclasses.replace(CONFIG, enable_expert_parallel=expert_parallel)
    *results, resumed = run_group([*jobs, migrated], tp, config)
    for name, result in zip(names, results):
        assert_exact(result, models[name][1], f"{name} at TP {tp}{' (expert parallel)' if expert_parallel else ''}")
    assert resumed.token_ids == [tokens[MIGRATE_AFTER:] for tokens in expected.tp1], f"migrated onto TP {tp}"


@pytest.mark.slow
def test_a_request_moves_from_tp1_onto_a_tp3_group_and_ends_as_at_tp1():
    # SmolLM2's split in small: 6 query heads, 3 KV heads, one KV head a rank at TP 3.
    folder, hf = save_tiny_model(
        "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=144
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 23)]
    expected = oracle(folder, hf, prompts)
    # The TP-1 engine's first tokens, continued by the group as a migrated request is (a decode worker
    # lost mid-stream: the new one prefills prompt + those tokens and decodes on).
    job = GroupJob(folder, prompts, NEW_TOKENS, resume_from=[tokens[:MIGRATE_AFTER] for tokens in expected.tp1])
    [resumed] = run_group([job], 3, CONFIG)
    assert expected.tp1 == expected.hf
    assert resumed.token_ids == [tokens[MIGRATE_AFTER:] for tokens in expected.tp1]
    assert len(set(resumed.steps_run)) == 1 and resumed.steps_run[0] > 0
