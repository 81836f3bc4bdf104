"""The roofline cost model's mixture-of-experts shape, and the planner sizing an MoE deployment,
against counts worked out by hand from the published model sizes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.cli import main as baton
from cluster.planner import PlanProblem, capacity_estimate
from cluster.sim import GPUS, MODELS, SLO, LengthDist, RooflineCostModel, StepShape, WorkloadSpec


def test_moe_shapes_have_the_published_total_and_active_parameter_counts():
    # Mixtral 8x7B: 46.7B total, 12.9B active; Qwen3-30B-A3B: 30.5B total, 3.3B active (untied embeddings).
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)):
        m = MODELS[name]
        assert m.layer_params + 2 * m.lm_head_params == pytest.approx(total, rel=0.01)
        assert m.active_layer_params + 2 * m.lm_head_params == pytest.approx(active, rel=0.02)


def test_moe_decode_reads_only_the_experts_its_tokens_were_routed_to():
    m = MODELS["mixtral-8x7b"]
    cost = RooflineCostModel(GPUS["H200"], m, "fp8", "fp8")
    attention = 4096 * 128 * (32 + 16) + 32 * 128 * 4096
    expert = 3 * 4096 * 14336
    # One token: 2 of the 8 experts per layer; the router (4096 x 8) and attention always.
    one = 32 * (attention + 4096 * 8 + 2 * expert) + 32000 * 4096
    kv = 2 * 32 * 8 * 128 * (1001 + 1)  # the context including the new token, and the new token written
    assert cost.step_time(StepShape.of([(1000, 1, True)])) == pytest.approx(
        (one + kv) / (4.8e12 * 0.8) + 0.0015, rel=1e-6
    )
    # 64 decode tokens touch all 8 experts in expectation (1 - (6/8)^64 ~ 1): the whole model streams.
    batch = StepShape.of([(1000, 1, True)] * 64)
    assert m.layer_params_read(64) == pytest.approx(m.layer_params, rel=1e-6)
    assert cost.step_time(batch) > cost.step_time(StepShape.of([(1000, 1, True)]))
    # Memory holds every expert; FLOPs count the active ones.
    assert cost.weight_bytes == m.layer_params + m.lm_head_params
    prefill = StepShape.of([(0, 8192, True)])
    flops = 2 * m.active_layer_params * 8192 + 2 * m.lm_head_params + 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    assert cost.step_time(prefill) == pytest.approx(flops / (1979e12 * 0.6) + 0.0015, rel=1e-6)


def test_dense_shapes_are_unchanged_by_the_moe_terms():
    m = MODELS["llama-8b"]
    assert m.active_layer_params == m.layer_params == m.layer_params_read(1) == m.layer_params_read(512)


def test_the_planner_sizes_an_moe_deployment():
    """Mixtral against a dense model of its total size (46.7B): the same memory, fewer FLOPs per
    token (12.9B active) and, at small decode batches, fewer bytes read per step."""
    wl = WorkloadSpec(rate=1, prompt_len=LengthDist("fixed", 1024), output_len=LengthDist("fixed", 128))
    moe = RooflineCostModel(GPUS["H200"], MODELS["mixtral-8x7b"], "fp8", "fp8")
    dense_shape = dataclasses.replace(
        MODELS["mixtral-8x7b"],
        name="dense-46b",
        intermediate=8 * 14336,
        experts=0,
        experts_per_tok=0,
        expert_intermediate=0,
    )
    dense = RooflineCostModel(GPUS["H200"], dense_shape, "fp8", "fp8")
    assert dense.weight_bytes == pytest.approx(moe.weight_bytes, rel=1e-3)
    est_moe = capacity_estimate(PlanProblem(8, wl, SLO(1.0, 0.05), moe))
    est_dense = capacity_estimate(PlanProblem(8, wl, SLO(1.0, 0.05), dense))
    # Prefill chunks of 256 tokens route to every expert, so both stream all 46.7 GB per chunk; the
    # MoE saves the FLOPs of 6 experts in 8.
    assert est_moe["prefill_requests_per_s_per_worker"] > 1.4 * est_dense["prefill_requests_per_s_per_worker"]
    # One decoding sequence reads 2 experts of 8 per layer: about 13 GB against 47 GB.
    one = StepShape.of([(1000, 1, True)])
    assert moe.step_time(one) - 0.0015 == pytest.approx((dense.step_time(one) - 0.0015) * 12.9 / 46.7, rel=0.03)


def test_baton_plan_takes_an_moe_roofline(tmp_path, capsys):
    workload = tmp_path / "w.yaml"
    workload.write_text("rate: 2\nduration_s: 20\nprompt_len: {dist: uniform, low: 256, high: 1024}\noutput_len: 64\n")
    # A tight TTFT keeps each rate probe short (the planner simulates at least 10 x the TTFT SLO).
    # The default 16-token blocks: an H200's 1.2M tokens of KV are 77k blocks per simulated worker
    # (4 in each of ~25 simulations), built only as they are used (they were 3/4 of this test's time
    # when each worker built its whole table first).
    code = baton(
        [
            "plan",
            "--gpus",
            "4",
            "--model-profile",
            "roofline:H200:mixtral-8x7b:fp8",
            "--slo-ttft",
            "50ms",
            "--slo-tpot",
            "50ms",
            "--workload",
            str(workload),
            "--requests-per-probe",
            "40",
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["plan"]["best"]["goodput"] > 0
    # It sized the deployment: more than one prefill/decode split simulated and compared.
    assert len({e["split"] for e in data["plan"]["evaluated"]}) > 1, data["plan"]["evaluated"]
