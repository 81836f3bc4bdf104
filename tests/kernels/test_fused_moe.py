"""Fused MoE (kernels/fused_moe.py): Triton (interpreted) against the reference, the reference against
a per-token loop in float64, over expert counts, top-k 1/2/8, uneven routing and empty experts."""

import pytest
import torch
from kernel_testlib import DEVICE, assert_close, dot_tol, gen, ops

from kernels import plan as P
from kernels.fused_moe import align_pairs, fused_moe_reference, fused_moe_triton

pytestmark = pytest.mark.slow  # the MoE kernels in the Triton interpreter: about 12 s here

DTYPES = [torch.float32, torch.bfloat16]


def per_token_oracle(x, w13, w2, weights, ids):
    """out[t] = sum_j w[t, j] * W2[e] (silu(W1[e] x) * W3[e] x), one token and slot at a time, float64."""
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def make_case(T, H, E, inter, K, dtype, routing="random", seed=0):
    g = gen(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * inter**-0.5).to(dtype)
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    elif routing == "skewed":  # most tokens to expert 0, experts past K + 1 left empty
        ids = torch.stack([torch.tensor([0] + [1 + (t + j) % K for j in range(K - 1)]) for t in range(T)])
    else:
        raise ValueError(routing)
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids.to(torch.int32))]


CASES = [
    # (tokens, hidden, experts, inter, top_k, routing)
    (1, 32, 4, 16, 1, "random"),
    (7, 48, 4, 24, 2, "random"),
    (19, 32, 8, 40, 2, "skewed"),  # uneven: expert 0 gets every token, experts 3..7 none
    (5, 64, 16, 32, 8, "random"),
    (33, 32, 8, 16, 8, "random"),  # top-k = E: every expert, more than one tile of rows each
    (40, 16, 3, 16, 1, "skewed"),  # all tokens on one expert, past one BLOCK_M
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-E{c[2]}-I{c[3]}-k{c[4]}-{c[5]}")
def test_triton_matches_reference(case, dtype):
    T, H, E, inter, K, routing = case
    args = make_case(T, H, E, inter, K, dtype, routing)
    ours = fused_moe_triton(*args)
    ref = fused_moe_reference(*args)
    assert ours.shape == (T, H) and ours.dtype == dtype
    assert_close(ours, ref, tol=dot_tol({torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}))
    assert torch.equal(ops.fused_moe(*args), ours)  # the KernelOps entry is this kernel


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"T{c[0]}-E{c[2]}-k{c[4]}-{c[5]}")
def test_reference_matches_per_token_oracle(case):
    T, H, E, inter, K, routing = case
    args = make_case(T, H, E, inter, K, torch.float32, routing, seed=3)
    torch.testing.assert_close(fused_moe_reference(*args).double().cpu(), per_token_oracle(*args), atol=1e-5, rtol=1e-5)


def test_align_pairs_sorts_by_expert_and_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])  # expert 0: pairs 1, 5; 1: pair 3; 2: pairs 0, 2, 4; 3: none
    pairs, block_expert = align_pairs(ids, num_experts=4, block_m=2)
    P_ = ids.numel()
    # Runs padded to 2: [1, 5] [3, pad] [0, 2] [4, pad]; then blocks past the end (bound min(3 + 4, 6) = 6).
    assert pairs.tolist() == [1, 5, 3, P_, 0, 2, 4, P_, P_, P_, P_, P_]
    assert block_expert.tolist() == [0, 1, 2, 2, 4, 4]


def test_empty_batch_and_bad_input():
    x, w13, w2, weights, ids = make_case(3, 16, 4, 16, 2, torch.float32)
    for fn in (fused_moe_triton, fused_moe_reference):
        assert fn(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe_triton(x, w13.bfloat16(), w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe_triton(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_reference(x, w13, w2, torch.ones(3, 5), torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert id"):
        fused_moe_reference(x, w13, w2, weights, torch.full_like(ids, 4))
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)


def test_cuda_plans_pick_short_tiles_for_decode():
    for target in ("sm_80", "sm_90", "sm_100"):
        dev = P.TARGETS[target]
        decode = P.fused_moe_plan(dev, num_pairs=8, num_experts=128, hidden=2048, inter=768, dtype="bfloat16", top_k=8)
        prefill = P.fused_moe_plan(
            dev, num_pairs=4096, num_experts=8, hidden=4096, inter=14336, dtype="bfloat16", top_k=2
        )
        assert decode.block_m == 16 and prefill.block_m == 64
        assert decode.gate_up.meta["BLOCK_M"] == decode.down.meta["BLOCK_M"] == 16
        f32 = P.fused_moe_plan(dev, num_pairs=8, num_experts=8, hidden=4096, inter=14336, dtype="float32", top_k=2)
        assert f32.gate_up.meta["PRECISION"] == "tf32" and f32.gate_up.meta["BLOCK_K"] == 32
