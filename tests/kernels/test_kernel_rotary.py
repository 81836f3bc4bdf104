"""RoPE: the cos/sin cache against transformers' own rotary embedding, the in-place kernel against the reference."""

import pytest
import torch
from kernel_testlib import DEVICE, assert_close, ops, randn

from kernels.rotary import build_rope_cache, rotary_embedding_reference, rotary_embedding_triton

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0}, LLAMA3, {"type": "linear", "factor": 2.0}],
)
def test_rope_cache_matches_transformers(rope_scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = {"rope_scaling": rope_scaling} if rope_scaling else {}
    cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=300, rope_theta=500000.0, **kw
    )
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(300)[None])
    cache = build_rope_cache(128, 300, 500000.0, rope_scaling)
    assert cache.dtype == torch.float32 and cache.shape == (300, 128)
    torch.testing.assert_close(cache[:, :64], cos[0, :, :64], atol=0, rtol=0)
    torch.testing.assert_close(cache[:, 64:], sin[0, :, :64], atol=0, rtol=0)


def test_rope_cache_rejects_unknown_type():
    with pytest.raises(ValueError, match="rope_scaling"):
        build_rope_cache(64, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_rotary_reference_matches_hf_apply():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T, D = 6, 64
    cache = build_rope_cache(D, 50, 10000.0, None)
    pos = torch.tensor([0, 3, 7, 49, 2, 2])
    q, k = randn(T, 4, D).cpu(), randn(T, 2, D, seed=1).cpu()
    cos = torch.cat([cache[pos, : D // 2]] * 2, -1)[None]
    sin = torch.cat([cache[pos, D // 2 :]] * 2, -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rotary_embedding_reference(pos, q, k, cache)
    assert_close(q, q_hf[0].transpose(0, 1))
    assert_close(k, k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,hq,hk", [(64, 4, 4), (128, 6, 2), (64, 24, 3)])
def test_rotary_in_place_on_fused_qkv_views(dtype, D, hq, hk):
    T = 5
    cache = build_rope_cache(D, 64, 10000.0, LLAMA3).to(DEVICE)
    pos = torch.tensor([0, 1, 63, 17, 5], device=DEVICE)
    qkv = randn(T, (hq + 2 * hk) * D, dtype=dtype)
    qkv_ref = qkv.clone()

    def views(t):
        return t[:, : hq * D].view(T, hq, D), t[:, hq * D : (hq + hk) * D].view(T, hk, D)

    rotary_embedding_triton(pos, *views(qkv), cache)
    rotary_embedding_reference(pos, *views(qkv_ref), cache)
    assert_close(qkv, qkv_ref)
    # V (the last third) is untouched.
    assert torch.equal(qkv[:, (hq + hk) * D :], qkv_ref[:, (hq + hk) * D :])


def test_rotary_single_token_and_empty():
    cache = build_rope_cache(64, 16, 10000.0, None).to(DEVICE)
    q, k = randn(1, 2, 64), randn(1, 1, 64, seed=1)
    q2, k2 = q.clone(), k.clone()
    pos = torch.tensor([9], device=DEVICE)
    ops.rotary_embedding(pos, q, k, cache)
    rotary_embedding_reference(pos, q2, k2, cache)
    assert_close(q, q2)
    assert_close(k, k2)
    ops.rotary_embedding(pos[:0], q[:0], k[:0], cache)
    with pytest.raises(ValueError, match="head_dim"):
        ops.rotary_embedding(pos, q, randn(1, 1, 32), cache)
