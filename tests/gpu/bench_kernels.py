"""GPU kernel benchmark: decode attention bandwidth, prefill attention TFLOP/s, FP8 GEMM TFLOP/s.

Run by tests/gpu/run.sh on a CUDA machine; prints one JSON document and writes it to --out.
Each figure comes with its ceiling (the H200 datasheet's 4.8 TB/s, and the copy bandwidth and
bf16 matmul rate measured here in the same run) and a correctness check against the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

from kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from kernels.fp8_gemm import fp8_gemm_reference, fp8_gemm_triton
from kernels.fp8_quant import scaled_fp8_quant_triton
from kernels.prefill_attention import paged_prefill_attention_reference, paged_prefill_attention_triton

H200_PEAK_BW = 4.8e12
H200_PEAK_BF16 = 989e12  # dense, datasheet
H200_PEAK_FP8 = 1979e12


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def measured_ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, well past L2
    y = torch.empty_like(x)
    ms = bench_ms(lambda src=x, dst=y: dst.copy_(src))  # bound here: `del x, y` below frees them
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = bench_ms(lambda: a @ b)
    del x, y
    return {"copy_bw_Bps": 2 * (1 << 30) / (ms * 1e-3), "bf16_matmul_8192_flops": 2 * 8192**3 / (mm * 1e-3)}


def paged_setup(B, ctx, hk, D, bs, cache_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = math.ceil(ctx / bs)
    num_blocks = B * nblk + 1
    k = torch.randn(num_blocks, bs, hk, D, device="cuda", dtype=torch.bfloat16, generator=g).to(cache_dtype)
    v = torch.randn(num_blocks, bs, hk, D, device="cuda", dtype=torch.bfloat16, generator=g).to(cache_dtype)
    bt = torch.randperm(B * nblk, device="cuda", generator=g).to(torch.int32).view(B, nblk)
    return k, v, bt


def bench_decode(B, ctx, hq, hk, D, bs, cache_dtype, ceil_bw):
    k, v, bt = paged_setup(B, ctx, hk, D, bs, cache_dtype)
    q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
    cl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    ks = vs = 0.05 if cache_dtype == torch.float8_e4m3fn else 1.0
    out = paged_decode_attention_triton(q, k, v, bt, cl, scale, ks, vs)
    ref = paged_decode_attention_reference(q, k, v, bt, cl, scale, ks, vs)
    err = (out.float() - ref.float()).abs().max().item()
    ms = bench_ms(lambda: paged_decode_attention_triton(q, k, v, bt, cl, scale, ks, vs))
    moved = 2 * B * ctx * hk * D * k.element_size() + 2 * q.numel() * q.element_size() + bt.numel() * 4
    bw = moved / (ms * 1e-3)
    return {
        "op": "paged_decode_attention",
        "B": B,
        "ctx": ctx,
        "Hq": hq,
        "Hk": hk,
        "D": D,
        "block_size": bs,
        "kv_dtype": str(cache_dtype),
        "ms": ms,
        "bytes": moved,
        "bandwidth_Bps": bw,
        "frac_of_4.8TBps": bw / H200_PEAK_BW,
        "frac_of_measured_copy": bw / ceil_bw,
        "max_abs_err": err,
    }


def bench_prefill(B, qlen, prefix, hq, hk, D, bs, cache_dtype, ceil_flops):
    ctx = qlen + prefix
    k, v, bt = paged_setup(B, ctx, hk, D, bs, cache_dtype, seed=1)
    q = torch.randn(B * qlen, hq, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, B + 1, device="cuda", dtype=torch.int32) * qlen
    cl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(D)
    ks = vs = 0.05 if cache_dtype == torch.float8_e4m3fn else 1.0
    out = paged_prefill_attention_triton(q, k, v, bt, qsl, cl, scale, ks, vs)
    # The reference is a per-sequence SDPA loop; check correctness on the first two sequences only.
    n_chk = min(B, 2)
    ref = paged_prefill_attention_reference(
        q[: n_chk * qlen], k, v, bt[:n_chk], qsl[: n_chk + 1], cl[:n_chk], scale, ks, vs
    )
    err = (out[: n_chk * qlen].float() - ref.float()).abs().max().item()
    ms = bench_ms(lambda: paged_prefill_attention_triton(q, k, v, bt, qsl, cl, scale, ks, vs))
    # Causal: query at position p sees p + 1 keys; QK^T and PV are 2 * D FLOPs each per (query, key, head).
    visible = B * sum(p + 1 for p in range(prefix, ctx))
    flops = 4 * D * hq * visible
    res = {
        "op": "paged_prefill_attention",
        "B": B,
        "q_len": qlen,
        "prefix": prefix,
        "Hq": hq,
        "Hk": hk,
        "D": D,
        "block_size": bs,
        "kv_dtype": str(cache_dtype),
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "frac_of_measured_bf16_matmul": flops / (ms * 1e-3) / ceil_flops,
        "max_abs_err": err,
    }
    if prefix == 0 and cache_dtype == torch.bfloat16:
        # Dense flash attention on the same problem, for scale (no paging, no GQA gather).
        qd = q.view(B, qlen, hq, D).transpose(1, 2)
        kd = torch.randn(B, hk, ctx, D, device="cuda", dtype=torch.bfloat16)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ms_sdpa = bench_ms(lambda: sdpa(qd, kd, kd, is_causal=True, enable_gqa=True))
        res["torch_sdpa_tflops"] = flops / (ms_sdpa * 1e-3) / 1e12
    return res


def bench_fp8_gemm(M, N, K, per_token):
    g = torch.Generator(device="cuda").manual_seed(2)
    a32 = torch.randn(M, K, device="cuda", generator=g)
    b32 = torch.randn(N, K, device="cuda", generator=g) * 0.05
    a, sa = scaled_fp8_quant_triton(a32, per_token=per_token)
    b, sb = scaled_fp8_quant_triton(b32, per_token=per_token)
    out = fp8_gemm_triton(a, b, sa, sb, torch.bfloat16)
    ref = fp8_gemm_reference(a, b, sa, sb, torch.bfloat16)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    flops = 2 * M * N * K
    ms = bench_ms(lambda: fp8_gemm_triton(a, b, sa, sb, torch.bfloat16))
    res = {
        "op": "fp8_gemm",
        "M": M,
        "N": N,
        "K": K,
        "scales": "per-token/per-channel" if per_token else "per-tensor",
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "frac_of_fp8_datasheet": flops / (ms * 1e-3) / H200_PEAK_FP8,
        "rel_err": rel,
    }
    try:
        sa_mm = sa if per_token else sa.reshape(())
        sb_mm = sb.reshape(1, N) if per_token else sb.reshape(())
        bt = b.t()  # column-major [K, N], what _scaled_mm wants
        ms_mm = bench_ms(lambda: torch._scaled_mm(a, bt, scale_a=sa_mm, scale_b=sb_mm, out_dtype=torch.bfloat16))
        res["torch_scaled_mm_tflops"] = flops / (ms_mm * 1e-3) / 1e12
        res["vs_torch_scaled_mm"] = ms_mm / ms
    except Exception as exc:  # keep the rest of the report
        res["torch_scaled_mm_error"] = repr(exc)[:300]
    a16, b16 = a32.to(torch.bfloat16), b32.to(torch.bfloat16)
    ms_bf16 = bench_ms(lambda: a16 @ b16.t())
    res["bf16_matmul_tflops"] = flops / (ms_bf16 * 1e-3) / 1e12
    res["vs_bf16_matmul"] = ms_bf16 / ms
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": [], "errors": []}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["errors"].append("triton missing")
    t0 = time.time()
    ceilings = measured_ceilings()
    report["ceilings"] = {**ceilings, "datasheet_bw_Bps": H200_PEAK_BW, "datasheet_bf16_flops": H200_PEAK_BF16}
    cases = [
        (bench_decode, (64, 4096, 32, 8, 128, 16, torch.bfloat16, ceilings["copy_bw_Bps"])),
        (bench_decode, (64, 4096, 32, 8, 128, 16, torch.float8_e4m3fn, ceilings["copy_bw_Bps"])),
        (bench_decode, (1, 32768, 32, 8, 128, 16, torch.bfloat16, ceilings["copy_bw_Bps"])),
        (bench_decode, (256, 1024, 32, 8, 128, 16, torch.bfloat16, ceilings["copy_bw_Bps"])),
        (bench_prefill, (4, 2048, 0, 32, 8, 128, 16, torch.bfloat16, ceilings["bf16_matmul_8192_flops"])),
        (bench_prefill, (2, 1024, 3072, 32, 8, 128, 16, torch.float8_e4m3fn, ceilings["bf16_matmul_8192_flops"])),
        (bench_fp8_gemm, (8192, 8192, 8192, False)),
        (bench_fp8_gemm, (8192, 8192, 8192, True)),
        (bench_fp8_gemm, (16, 8192, 8192, True)),
        (bench_fp8_gemm, (256, 14336, 4096, True)),
    ]
    for fn, case_args in cases:
        try:
            r = fn(*case_args)
            report["results"].append(r)
            print(json.dumps(r), flush=True)
        except Exception:
            report["errors"].append(f"{fn.__name__}{case_args[:4]}: {traceback.format_exc()[-1500:]}")
            print(report["errors"][-1], flush=True)
        torch.cuda.empty_cache()
    report["wall_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
