"""The launch plans as the Markdown table docs/development.md shows under "Kernel plans" (its
<!-- kernel-plans --> markers; tests/kernels/test_kernel_plan.py checks that they agree):
`python -c 'from kernels.plan_table import plan_table; print(plan_table())'`."""

from __future__ import annotations

from kernels.device_spec import TARGETS
from kernels.plan import FP8, DecodePlan, decode_attention_plan, fp8_gemm_plan, fused_moe_plan, prefill_attention_plan

__all__ = ["plan_table"]


def _cell(fn, *args, **kwargs) -> str:
    try:
        p = fn(*args, **kwargs)
    except ValueError:
        return "refused"
    if isinstance(p, DecodePlan):
        m = p.split.meta
        return f"N{m['BLOCK_N']} w{p.split.num_warps} s{p.split.num_stages} splits {p.num_splits}" + (
            f" {m['PRECISION']}" if m["DOT_F32"] else ""
        )
    m = p.meta
    if "BLOCK_K" in m:
        return f"{m['BLOCK_M']}x{m['BLOCK_N']}x{m['BLOCK_K']} w{p.num_warps} s{p.num_stages}"
    return f"M{m['BLOCK_M']} N{m['BLOCK_N']} w{p.num_warps} s{p.num_stages}" + (
        f" {m['PRECISION']}" if m["DOT_F32"] else ""
    )


def plan_table() -> str:
    """The Markdown table docs/development.md shows under "Kernel plans" (Llama-3-8B's shapes:
    32 q / 8 kv heads, head_dim 128, block size 16; Mixtral 8x7B's for the fused MoE). Cells: tiles
    (M/N/K), w warps, s stages,
    splits for decode, the dot precision when dots run on float32 operands; "refused": the plan
    raises (FP8 below sm_89)."""
    attn = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    mixtral = dict(num_experts=8, hidden=4096, inter=14336, dtype="bfloat16", top_k=2)
    moe_decode, moe_prefill = dict(mixtral, num_pairs=16), dict(mixtral, num_pairs=4096)
    rows = [
        (
            "decode bf16, batch 8, 4k context",
            lambda d: _cell(
                decode_attention_plan, d, batch=8, max_ctx=4096, dtype="bfloat16", kv_dtype="bfloat16", **attn
            ),
        ),
        (
            "decode fp32, batch 8, 4k context",
            lambda d: _cell(
                decode_attention_plan, d, batch=8, max_ctx=4096, dtype="float32", kv_dtype="float32", **attn
            ),
        ),
        (
            "decode bf16, FP8 KV, batch 8, 4k context",
            lambda d: _cell(decode_attention_plan, d, batch=8, max_ctx=4096, dtype="bfloat16", kv_dtype=FP8, **attn),
        ),
        (
            "prefill bf16, 2k-token prompt",
            lambda d: _cell(prefill_attention_plan, d, max_q=2048, dtype="bfloat16", kv_dtype="bfloat16", **attn),
        ),
        (
            "prefill fp32, 2k-token prompt",
            lambda d: _cell(prefill_attention_plan, d, max_q=2048, dtype="float32", kv_dtype="float32", **attn),
        ),
        ("FP8 GEMM, M=8 (decode)", lambda d: _cell(fp8_gemm_plan, d, M=8, N=4096, K=4096)),
        ("FP8 GEMM, M=2048, bias", lambda d: _cell(fp8_gemm_plan, d, M=2048, N=4096, K=4096, has_bias=True)),
        (
            "fused MoE bf16 gate_up / down, Mixtral 8x7B, 8 decode tokens",
            lambda d: " / ".join(
                _cell(lambda *a, step=step, **k: getattr(fused_moe_plan(*a, **k), step), d, **moe_decode)
                for step in ("gate_up", "down")
            ),
        ),
        (
            "fused MoE bf16 gate_up / down, Mixtral 8x7B, 2k-token prefill",
            lambda d: " / ".join(
                _cell(lambda *a, step=step, **k: getattr(fused_moe_plan(*a, **k), step), d, **moe_prefill)
                for step in ("gate_up", "down")
            ),
        ),
    ]
    names = list(TARGETS)
    lines = ["| launch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(TARGETS[n]) for n in names) + " |")
    return "\n".join(lines)
