"""Every Triton kernel, as the launch plans (kernels/plan.py) choose it for real model shapes,
compiled ahead of time for sm_90 and sm_100 (and sm_89 / sm_80 where it is meant to run) with the
ptxas inside the triton wheel: no GPU, no driver.

Asserted per specialisation: it compiles; ptxas spills at most SPILL_TOLERANCE bytes (stores +
loads); shared memory fits the target (SMEM_LIMIT); threads fit (1024); the FP8 GEMM's PTX uses
the target's tensor-core instructions (wgmma on sm_90, tcgen05 on sm_100).

By default (`make test`) a covering subset is compiled, chosen by rule (covering_subset): in every
compile_group (kernel, target, activation dtype, KV / weight dtype, window + soft-cap variant) the
specialisations most likely to fail (largest tile_load, largest head_dim), and every FP8 GEMM
tensor-core tile config on sm_90 / sm_100 once; test_covering_subset_rule checks that rule.
BATON_COMPILE_ALL=1 compiles every specialisation.

The compiles run in one subprocess per usable CPU (at least 2) with TRITON_INTERPRET=0 (this
session sets it to 1, which breaks real compiles of kernels with reductions), each with a fresh
TRITON_CACHE_DIR and `always_compile`, so nothing cached by an earlier run can hide a failure;
each takes its next job when done with the last, the heaviest first. Each process imports torch
and triton once (about 2 CPU-seconds); the rest is the compiles themselves (CPU time on the
subset: TTGIR passes 24 %, LLVM lowering and optimisation 42 %, PTX emission 8 %, ptxas 15 %,
AST to TTIR 5 %, cache keys and files 7 %). In a session that collects the check, the compiles
start at collection, at the lowest priority (tests/kernels/conftest.py, background.py,
tests/idle_priority.py): they use the CPU time the earlier tests leave idle, and the test then only
collects their results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernels import plan as P
from kernels.fp8_quant import MIN_SCALE
from kernels.lora import lora_plan
from tests import idle_priority
from tests.kernels.aot_compile import RESULT_PREFIX
from tests.kernels.background import COMPILES

ROOT = Path(__file__).resolve().parents[2]

# ptxas spill bytes (stores + loads) one specialisation may have: none. A spill means local-memory
# traffic in the hot loop; a plan that spills must change its tiles or warps instead.
SPILL_TOLERANCE = 0
KIB = 1024
SMEM_LIMIT = {80: 163 * KIB, 86: 99 * KIB, 89: 99 * KIB, 90: 227 * KIB, 100: 227 * KIB}
MAX_THREADS = 1024
TC_MARKER = {90: "wgmma", 100: "tcgen05"}

# (q heads, kv heads, head_dim, hidden, intermediate)
MODELS = {
    "llama3-8b": (32, 8, 128, 4096, 14336),
    "qwen2.5-7b": (28, 4, 128, 3584, 18944),
    "smollm2-135m": (9, 3, 64, 576, 1536),
}
BLOCK_SIZE = 16
MAX_CTX = 4096  # the block table width times the block size a decode batch is planned for
TT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}
ACT = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn


def _arches(fp8: bool) -> tuple[int, ...]:
    # FP8 is refused below sm_89 (kernels.plan.check_fp8_supported); everything else runs on sm_80 too.
    return (90, 100, 89) if fp8 else (90, 100, 89, 80)


def _spec(arch: int) -> P.DeviceSpec:
    return P.TARGETS[f"sm_{arch}"]


def _job(
    tag: str, arch: int, plan: P.LaunchPlan, args: dict[str, str], divisible=(), *, dtypes: tuple[str, str]
) -> dict:
    """One specialisation; `dtypes` is (activation dtype, storage dtype: the KV cache's or the
    weights'), as triton type names, for compile_group."""
    return {
        "id": f"{tag} @sm_{arch}",
        "kernel": plan.kernel,
        "args": args,
        "constexprs": dict(plan.meta),
        "divisible": list(divisible),
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
        "arch": arch,
        "dtypes": list(dtypes),
    }


def _ptrs(**names) -> dict[str, str]:
    return {n: "*" + t for n, t in names.items()}


def _i32(*names) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


def _attention_cases():
    """(model, activation dtype, KV dtype, arch, decode batches, prefill max_q): a representative
    subset, all of it on sm_90 / sm_100 for Llama-3-8B, the largest tiles elsewhere."""
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    for model in MODELS:
        full = model == "llama3-8b"
        combos = (
            [(bf16, bf16), (f16, f16), (f32, f32), (bf16, FP8), (f16, FP8), (f32, FP8)]
            if full
            else [(bf16, bf16), (f32, f32), (bf16, FP8), (f32, FP8)]
        )
        for act, kv in combos:
            for arch in _arches(kv == FP8):
                if arch in (90, 100):
                    yield model, act, kv, arch, (1, 8, 256) if full else (1, 256), (16, 64, 512) if full else (16, 512)
                elif full and act != torch.float16:
                    yield model, act, kv, arch, (1, 256), (16, 512)


def attention_jobs() -> list[dict]:
    jobs = []
    for model, act, kv, arch, batches, prefills in _attention_cases():
        hq, hk, d, _, _ = MODELS[model]
        a, c = TT[act], TT[kv]
        shape = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, block_size=BLOCK_SIZE, dtype=act, kv_dtype=kv)
        dev = _spec(arch)
        for batch in batches:
            dp = P.decode_attention_plan(dev, batch=batch, max_ctx=MAX_CTX, **shape)
            mid = "fp32" if dp.merge else a
            args = {
                **_ptrs(
                    q_ptr=a, k_ptr=c, v_ptr=c, bt_ptr="i32", lens_ptr="i32", out_ptr=a, mid_o_ptr=mid, mid_lse_ptr=mid
                ),
                "qk_scale": "fp32",
                "v_scale": "fp32",
                "window": "i32",
                "softcap_log2e": "fp32",
                **_i32("split_len", "max_ctx", "stride_qb", "stride_qh", "stride_bt", "stride_ob", "stride_oh"),
            }
            div = [n for n in args if n.endswith("_ptr")] + [
                "split_len",
                "max_ctx",
                "stride_qb",
                "stride_qh",
                "stride_ob",
                "stride_oh",
            ]
            tag = f"decode {model} {a}/{c} b{batch}"
            jobs.extend(
                _window_variants(_job(tag, arch, dp.split, args, div, dtypes=(a, c)), arch, batch == batches[0])
            )
            if dp.merge:
                margs = {
                    **_ptrs(mid_o_ptr="fp32", mid_lse_ptr="fp32", out_ptr=a),
                    **_i32("stride_ob", "stride_oh", "H"),
                }
                jobs.append(
                    _job(
                        f"merge {model} {a} b{batch}",
                        arch,
                        dp.merge,
                        margs,
                        ["mid_o_ptr", "mid_lse_ptr", "out_ptr", "stride_ob", "stride_oh"],
                        dtypes=(a, "fp32"),
                    )
                )
        for max_q in prefills:  # the prefill tiles: short, medium, long prompts
            pp = P.prefill_attention_plan(dev, max_q=max_q, **shape)
            windowed = P.prefill_attention_plan(dev, max_q=max_q, windowed=True, **shape)
            args = {
                **_ptrs(q_ptr=a, k_ptr=c, v_ptr=c, bt_ptr="i32", qsl_ptr="i32", lens_ptr="i32", out_ptr=a),
                "qk_scale": "fp32",
                "v_scale": "fp32",
                "window": "i32",
                "softcap_log2e": "fp32",
                **_i32("max_ctx", "stride_qt", "stride_qh", "stride_bt", "stride_ot", "stride_oh"),
            }
            div = [n for n in args if n.endswith("_ptr")] + [
                "max_ctx",
                "stride_qt",
                "stride_qh",
                "stride_ot",
                "stride_oh",
            ]
            tag = f"prefill {model} {a}/{c} q{max_q}"
            jobs.extend(
                _window_variants(
                    _job(tag, arch, pp, args, div, dtypes=(a, c)),
                    arch,
                    max_q in (prefills[0], prefills[-1]),
                    _job(tag, arch, windowed, args, div, dtypes=(a, c)),
                )
            )
    return jobs


def _window_variants(job: dict, arch: int, windowed_shape: bool, windowed_job: dict | None = None) -> list[dict]:
    """The plain attention job (no sliding window, no soft-cap: every non-Gemma model), and on
    sm_90 for the shapes the caller picks (a decode case's first batch, a prefill case's shortest
    and longest prompts) also the Gemma 2 one (window and soft-cap on), from `windowed_job` where
    the plan takes other tiles with a window."""
    plain = {**job, "constexprs": {**job["constexprs"], "HAS_WINDOW": False, "SOFTCAP": False}}
    if arch != 90 or not windowed_shape:
        return [plain]
    windowed_job = windowed_job or job
    return [
        plain,
        {
            **windowed_job,
            "id": windowed_job["id"].replace(" @", " window+softcap @"),
            "constexprs": {**windowed_job["constexprs"], "HAS_WINDOW": True, "SOFTCAP": True},
        },
    ]


def fp8_jobs() -> list[dict]:
    jobs = []
    for model, (hq, hk, d, hidden, inter) in MODELS.items():
        for arch in _arches(True):
            dev = _spec(arch)
            # qkv, o, gate_up and down projections: (N, K)
            for n, k in (((hq + 2 * hk) * d, hidden), (hidden, hq * d), (2 * inter, hidden), (hidden, inter)):
                for m in (8, 256):
                    for bias in (False, True):
                        gp = P.fp8_gemm_plan(dev, M=m, N=n, K=k, has_bias=bias, sa_per_row=True, sb_per_col=True)
                        args = {
                            **_ptrs(
                                a_ptr="fp8e4nv",
                                b_ptr="fp8e4nv",
                                sa_ptr="fp32",
                                sb_ptr="fp32",
                                bias_ptr="bf16" if bias else "fp32",
                                c_ptr="bf16",
                            ),
                            **_i32("M", "N", "K", "stride_am", "stride_bn", "stride_cm"),
                        }
                        div = [x for x in args if x.endswith("_ptr")] + [
                            "N",
                            "K",
                            "stride_am",
                            "stride_bn",
                            "stride_cm",
                        ]
                        job = _job(
                            f"fp8_gemm {model} {n}x{k} M{m}{' bias' if bias else ''}",
                            arch,
                            gp,
                            args,
                            div,
                            dtypes=("fp8e4nv", "fp8e4nv"),
                        )
                        job["want_ptx"] = TC_MARKER.get(arch)
                        jobs.append(job)
            for act in ACT:
                for dynamic_row, per_row in ((True, True), (False, False)):
                    qp = P.fp8_quant_plan(
                        dev, N=hidden, dynamic_row=dynamic_row, scale_per_row=per_row, min_scale=MIN_SCALE
                    )
                    args = {
                        **_ptrs(x_ptr=TT[act], out_ptr="fp8e4nv", scale_ptr="fp32"),
                        **_i32("N", "stride_x", "stride_out"),
                    }
                    jobs.append(
                        _job(
                            f"fp8_quant {model} {TT[act]} row={per_row}",
                            arch,
                            qp,
                            args,
                            ["x_ptr", "out_ptr", "scale_ptr", "N", "stride_x", "stride_out"],
                            dtypes=(TT[act], "fp8e4nv"),
                        )
                    )
    return jobs


def elementwise_jobs() -> list[dict]:
    jobs = []
    for model, (hq, hk, d, hidden, _inter) in MODELS.items():
        for act in ACT:
            a = TT[act]
            for arch in _arches(False) if model == "llama3-8b" else (90, 100):
                dev = _spec(arch)
                for kv in (act, FP8):
                    if kv == FP8 and not P.fp8_supported(dev):
                        continue
                    sp = P.store_kv_plan(dev, num_heads=hk, head_dim=d, kv_dtype=kv)
                    args = {
                        **_ptrs(key_ptr=a, value_ptr=a, k_cache_ptr=TT[kv], v_cache_ptr=TT[kv], slot_ptr="i64"),
                        **_i32("H", "D", "stride_kt", "stride_kh", "stride_vt", "stride_vh"),
                        "k_scale": "fp32",
                        "v_scale": "fp32",
                    }
                    jobs.append(
                        _job(
                            f"store_kv {model} {a}/{TT[kv]}",
                            arch,
                            sp,
                            args,
                            [x for x in args if x.endswith("_ptr")],
                            dtypes=(a, TT[kv]),
                        )
                    )
                for res in (False, True):
                    rp = P.rms_norm_plan(dev, hidden=hidden, has_residual=res)
                    args = {
                        **_ptrs(x_ptr=a, r_ptr=a, w_ptr=a, out_ptr=a, sum_ptr=a),
                        **_i32("H", "stride_x", "stride_r", "stride_out", "stride_sum"),
                        "eps": "fp32",
                    }
                    jobs.append(
                        _job(
                            f"rms_norm {model} {a} res={res}",
                            arch,
                            rp,
                            args,
                            [x for x in args if x.endswith("_ptr")] + ["H", "stride_x", "stride_out"],
                            dtypes=(a, a),
                        )
                    )
                for heads in (hq, hk):
                    op = P.rotary_plan(dev, num_heads=heads, head_dim=d)
                    args = {
                        **_ptrs(pos_ptr="i64", x_ptr=a, cache_ptr="fp32"),
                        **_i32("H", "stride_xt", "stride_xh", "stride_cache"),
                    }
                    jobs.append(
                        _job(
                            f"rotary {model} {a} h{heads}",
                            arch,
                            op,
                            args,
                            ["pos_ptr", "x_ptr", "cache_ptr", "stride_xt", "stride_xh", "stride_cache"],
                            dtypes=(a, a),
                        )
                    )
                mp = P.silu_mul_plan(dev)
                args = {**_ptrs(x_ptr=a, out_ptr=a), **_i32("inter", "stride_x", "stride_out")}
                jobs.append(
                    _job(
                        f"silu_mul {model} {a}",
                        arch,
                        mp,
                        args,
                        ["x_ptr", "out_ptr", "inter", "stride_x", "stride_out"],
                        dtypes=(a, a),
                    )
                )
                # GeGLU (Gemma) launches with silu_mul's plan (kernels/gelu_tanh_and_mul.py).
                jobs.append(
                    {
                        **_job(
                            f"gelu_mul {model} {a}",
                            arch,
                            mp,
                            args,
                            ["x_ptr", "out_ptr", "inter", "stride_x", "stride_out"],
                            dtypes=(a, a),
                        ),
                        "kernel": "kernels.gelu_tanh_and_mul:_gelu_tanh_mul_kernel",
                    }
                )
    for arch in _arches(False):
        for scatter in (False, True):
            bp = P.block_copy_plan(_spec(arch), scatter=scatter)
            args = {**_ptrs(src_ptr="i64", dst_ptr="i64", ids_ptr="i64"), **_i32("n_ids", "n_blocks", "block_elems")}
            jobs.append(
                _job(
                    f"block_copy scatter={scatter}",
                    arch,
                    bp,
                    args,
                    ["src_ptr", "dst_ptr", "ids_ptr"],
                    dtypes=("i64", "i64"),
                )
            )  # raw 8-byte words, whatever the cache's dtype
        sp = P.block_sums_plan(_spec(arch))
        args = {**_ptrs(words_ptr="i64", ids_ptr="i64", out_ptr="i64"), **_i32("n_blocks", "rows", "piece_words")}
        jobs.append(_job("block_sums", arch, sp, args, ["words_ptr", "ids_ptr", "out_ptr"], dtypes=("i64", "i64")))
    return jobs


# (experts, top_k, hidden, one expert's intermediate size)
MOE_MODELS = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def moe_jobs() -> list[dict]:
    """The fused MoE's two launches (gate_up, down) for decode (8 tokens) and prefill (1024) batches."""
    jobs = []
    for model, (experts, top_k, hidden, inter) in MOE_MODELS.items():
        for act in (torch.bfloat16, torch.float32):
            a = TT[act]
            # bfloat16 on every target; float32 MoE (a CPU default, rare on GPUs) on sm_90 only.
            for arch in _arches(False) if act == torch.bfloat16 else (90,):
                for tokens in (8, 1024):
                    mp = P.fused_moe_plan(
                        _spec(arch),
                        num_pairs=tokens * top_k,
                        num_experts=experts,
                        hidden=hidden,
                        inter=inter,
                        dtype=act,
                        top_k=top_k,
                    )
                    for step, plan, out in (("gate_up", mp.gate_up, a), ("down", mp.down, "fp32")):
                        args = {
                            **_ptrs(
                                a_ptr=a, b_ptr=a, c_ptr=out, weights_ptr="fp32", pairs_ptr="i32", block_expert_ptr="i32"
                            ),
                            **_i32(
                                "num_pairs", "N", "K", "num_experts", "stride_am", "stride_be", "stride_bn", "stride_cm"
                            ),
                        }
                        div = [x for x in args if x.endswith("_ptr")] + [
                            "N",
                            "K",
                            "stride_am",
                            "stride_be",
                            "stride_bn",
                            "stride_cm",
                        ]
                        jobs.append(
                            _job(f"fused_moe {step} {model} {a} t{tokens}", arch, plan, args, div, dtypes=(a, a))
                        )
    return jobs


# Batched LoRA (kernels/lora.py): ranks 16 (the default --max-lora-rank) and 64 (the plan's widest
# rank tile; larger ranks loop over tiles of 64); rows of a decode batch (8: one tile of rows, left
# unsorted) and of prefills (256, 1024: sorted by slot, the larger row tiles). The tiles do not
# depend on the projection's widths (those only set the split-K, a runtime argument).
LORA_RANKS = (16, 64)
LORA_ROWS = (8, 256, 1024)


def lora_jobs() -> list[dict]:
    """The shrink and expand launches for Llama-3-8B's q projection: bfloat16 on every target,
    float16 on sm_90 / sm_100, float32 (TF32 dots) on sm_90."""
    jobs = []
    hq, _, d, hidden, _ = MODELS["llama3-8b"]
    for act in ACT:
        a = TT[act]
        arches = {torch.bfloat16: _arches(False), torch.float16: (90, 100), torch.float32: (90,)}[act]
        for arch in arches:
            for rank in LORA_RANKS:
                for rows in LORA_ROWS:
                    lp = lora_plan(
                        _spec(arch), rows=rows, in_features=hidden, out_features=hq * d, rank=rank, dtype=act
                    )
                    order = "i64" if lp.gather else "i32"  # torch.sort's indices, or the (unused) slot ids
                    tag = f"{a} r{rank} rows{rows}"
                    args = {
                        **_ptrs(x_ptr=a, a_ptr=a, slots_ptr="i32", order_ptr=order, t_ptr="fp32"),
                        **_i32("rows", "K", "R", "k_per_split", "stride_x", "stride_as", "stride_ar"),
                    }
                    div = [x for x in args if x.endswith("_ptr")] + ["K", "R", "k_per_split", "stride_x"]
                    div += ["stride_as", "stride_ar"]
                    jobs.append(_job(f"lora_shrink {tag}", arch, lp.shrink, args, div, dtypes=(a, a)))
                    args = {
                        **_ptrs(t_ptr="fp32", b_ptr=a, slots_ptr="i32", order_ptr=order, scaling_ptr="fp32", y_ptr=a),
                        **_i32("rows", "N", "R", "split_k", "stride_bs", "stride_bn", "stride_y"),
                    }
                    div = [x for x in args if x.endswith("_ptr")] + ["N", "R", "stride_bs", "stride_bn", "stride_y"]
                    jobs.append(_job(f"lora_expand {tag}", arch, lp.expand, args, div, dtypes=(a, a)))
    return jobs


def all_jobs() -> list[dict]:
    """Every distinct specialisation (same kernel, constexprs, options, argument types and target: once)."""
    seen, out = set(), []
    for job in attention_jobs() + fp8_jobs() + elementwise_jobs() + moe_jobs() + lora_jobs():
        key = json.dumps({k: v for k, v in job.items() if k != "id"}, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(job)
    return out


def compile_group(job: dict) -> tuple:
    """What a covering run must compile at least once: (kernel, target, activation dtype, KV cache /
    weight dtype, variant: sliding-window + soft-cap attention, LoRA rows sorted by slot, or plain)."""
    consts = job["constexprs"]
    if consts.get("HAS_WINDOW") or consts.get("SOFTCAP"):
        variant = "window+softcap"
    else:
        variant = "sorted" if consts.get("GATHER") else "plain"
    return job["kernel"], job["arch"], *job["dtypes"], variant


def tile_load(job: dict) -> int:
    """Tile elements x stages x warps: what grows registers and shared memory, so what spills first."""
    consts = job["constexprs"]
    tile = 1
    for name, value in consts.items():
        if name == "BLOCK" or name.startswith("BLOCK_"):
            tile *= value
    return tile * (job["num_stages"] or 1) * job["num_warps"]


def head_dim(job: dict) -> int:
    """The head dimension a specialisation is built for (0 for kernels without one)."""
    consts = job["constexprs"]
    return consts.get("D") or 2 * consts.get("HALF", 0) or consts.get("BLOCK_D", 0)


def tensor_core_config(job: dict) -> tuple | None:
    """(target, tiles, warps, stages) of a job whose PTX must use the tensor-core instructions."""
    if not job.get("want_ptx"):
        return None
    consts = job["constexprs"]
    return job["arch"], consts["BLOCK_M"], consts["BLOCK_N"], consts["BLOCK_K"], job["num_warps"], job["num_stages"]


def covering_subset(jobs: list[dict]) -> list[dict]:
    """The default run's jobs, chosen by rule: in every compile_group the specialisation with the
    largest tile_load and the one with the largest head_dim (often the same one), and for every
    tensor_core_config (FP8 GEMM tiles on sm_90 / sm_100) one job. In the order of `jobs`."""
    groups: dict[tuple, list[dict]] = {}
    for job in jobs:
        groups.setdefault(compile_group(job), []).append(job)
    chosen = set()
    for members in groups.values():
        chosen.add(max(members, key=lambda j: (tile_load(j), head_dim(j)))["id"])
        chosen.add(max(members, key=lambda j: (head_dim(j), tile_load(j)))["id"])
    configs = {tensor_core_config(j) for j in jobs if j["id"] in chosen}
    for job in jobs:
        if (config := tensor_core_config(job)) is not None and config not in configs:
            configs.add(config)
            chosen.add(job["id"])
    return [j for j in jobs if j["id"] in chosen]


def jobs_to_compile() -> list[dict]:
    """The covering subset; every specialisation with BATON_COMPILE_ALL=1."""
    everything = all_jobs()
    return everything if os.environ.get("BATON_COMPILE_ALL", "0") not in ("", "0") else covering_subset(everything)


# Rough seconds one compile of each kernel takes here: only the order jobs are handed out in
# (the heaviest first), so that neither worker is left with a long one while the other has finished.
COST_HINT = {"_prefill_kernel": 2.2, "_decode_split_kernel": 1.9, "_fp8_gemm_kernel": 2.0, "_moe_gemm_kernel": 0.8}


def _cost_hint(job: dict) -> float:
    return COST_HINT.get(job["kernel"].split(":")[1], 0.3)


def run_compiles(
    jobs: list[dict],
    procs: int | None = None,
    timeout: float = 900,
    lowest_priority: bool = False,
    started: list | None = None,
) -> list[dict]:
    """Compile `jobs` in `procs` fresh subprocesses (TRITON_INTERPRET=0, an empty cache dir each),
    each given its next job when it has answered the last, the heaviest jobs first. By default one
    process per usable CPU, at least 2. The subprocesses run at the lowest priority if asked
    (tests/idle_priority.py) and are appended to `started` as they start (so that whoever started
    this in the background can end them)."""
    procs = procs or max(2, len(os.sched_getaffinity(0)))
    queue = sorted(jobs, key=_cost_hint, reverse=True)
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="baton-aot-") as tmp:
        workers = []
        for i in range(min(procs, len(jobs))):
            env = dict(
                os.environ,
                TRITON_INTERPRET="0",
                TRITON_CACHE_DIR=os.path.join(tmp, f"cache{i}"),
                TRITON_DEFAULT_FP_FUSION="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            )
            err = open(os.path.join(tmp, f"stderr{i}"), "w+")  # a file: a full stderr pipe would block the worker
            popen = idle_priority.popen_at_lowest_priority if lowest_priority else subprocess.Popen
            proc = popen(
                [sys.executable, "-m", "tests.kernels.aot_compile"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            workers.append((proc, err))
            if started is not None:
                started.append(proc)

        def feed(proc: subprocess.Popen) -> tuple[list[dict], str | None]:
            answered = []
            while True:
                with lock:
                    if not queue:
                        break
                    job = queue.pop(0)
                try:
                    proc.stdin.write(json.dumps(job) + "\n")
                    proc.stdin.flush()
                except OSError as e:  # the worker has died
                    return answered, f"{e!r} sending {job['id']}"
                while (line := proc.stdout.readline()) and not line.startswith(RESULT_PREFIX):
                    pass
                if not line:
                    return answered, f"ended without answering {job['id']}"
                answered.append(json.loads(line[len(RESULT_PREFIX) :]))
            proc.stdin.close()
            return answered, None

        # Past the deadline every worker is killed: its feeder then sees its stdout end.
        deadline = threading.Timer(timeout, lambda: [proc.kill() for proc, _ in workers])
        deadline.start()
        try:
            with ThreadPoolExecutor(len(workers)) as pool:
                answers = list(pool.map(feed, [proc for proc, _ in workers]))
        finally:
            deadline.cancel()
        results = []
        for (proc, err), (answered, failure) in zip(workers, answers):
            proc.wait()
            err.seek(0)
            assert failure is None and proc.returncode == 0, (
                f"compile worker failed ({failure}, exit {proc.returncode}):\n{err.read()[-4000:]}"
            )
            err.close()
            results += answered
    return results


def problems(jobs: list[dict], results: list[dict]) -> list[str]:
    by_id = {j["id"]: j for j in jobs}
    bad = []
    for r in results:
        job = by_id[r["id"]]
        arch = job["arch"]
        if not r["ok"]:
            bad.append(f"{r['id']}: does not compile: {r['error']}")
            continue
        if r["spill_bytes"] > SPILL_TOLERANCE:
            bad.append(
                f"{r['id']}: spills {r['spill_bytes']} B (tolerance {SPILL_TOLERANCE} B), {r['registers']} registers"
            )
        if r["shared"] > SMEM_LIMIT[arch]:
            bad.append(f"{r['id']}: needs {r['shared']} B of shared memory, sm_{arch} has {SMEM_LIMIT[arch]}")
        if r["threads"] > MAX_THREADS:
            bad.append(f"{r['id']}: {r['threads']} threads per block")
        want = job.get("want_ptx")
        if want and not r["ptx_has"].get(want):
            bad.append(f"{r['id']}: PTX has no {want} (found {r['ptx_has']})")
    return bad


def test_every_kernel_has_jobs():
    """Each @triton.jit kernel in kernels/ is compiled by the check for sm_90 and sm_100."""
    import importlib
    import pkgutil

    import kernels
    from kernels._triton_compat import LazyJIT

    found = set()
    for mod in pkgutil.iter_modules(kernels.__path__):
        m = importlib.import_module(f"kernels.{mod.name}")
        found |= {f"kernels.{mod.name}:{n}" for n, v in vars(m).items() if isinstance(v, LazyJIT)}
    covered = {(j["kernel"], j["arch"]) for j in all_jobs()}
    missing = [(k, a) for k in sorted(found) for a in (90, 100) if (k, a) not in covered]
    assert found and not missing, f"kernels the compile check does not cover: {missing}"


def test_covering_subset_rule():
    """The default run's subset covers every group of the full matrix with its riskiest members
    and every tensor-core tile config, and is strictly smaller."""
    full = all_jobs()
    subset = covering_subset(full)
    ids = {j["id"] for j in subset}
    assert ids < {j["id"] for j in full}
    for job in full:  # the group labels agree with the argument types the kernel is compiled for
        pointee = {t[1:] for t in job["args"].values() if t.startswith("*")}
        assert set(job["dtypes"]) <= pointee, (job["id"], job["dtypes"], pointee)
    # Hand-counted from _attention_cases: decode on sm_90 is 6 (activation, KV) pairs x plain / Gemma.
    decode_sm90 = {compile_group(j) for j in full if j["kernel"].endswith(":_decode_split_kernel") and j["arch"] == 90}
    assert len(decode_sm90) == 12, sorted(decode_sm90)
    groups: dict[tuple, list[dict]] = {}
    for job in full:
        groups.setdefault(compile_group(job), []).append(job)
    for group, members in groups.items():
        picked = [j for j in members if j["id"] in ids]
        assert picked, f"group {group} not compiled by default"
        for measure in (tile_load, head_dim):
            assert max(map(measure, picked)) == max(map(measure, members)), (group, measure.__name__)
    tc_full = {tensor_core_config(j) for j in full} - {None}
    assert {a for a, *_ in tc_full} == {90, 100}
    assert tc_full == {tensor_core_config(j) for j in subset} - {None}


@pytest.mark.slow  # the subset, 183 specialisations: about a third of the CPU time of BATON_COMPILE_ALL=1's 535
def test_kernels_compile_for_targets(request):
    background = request.config.stash.get(COMPILES, None)  # tests/kernels/conftest.py
    if background is not None:  # started at collection, in the time earlier tests left a core idle
        jobs, results = background.jobs, background.results.result()
    else:
        jobs = jobs_to_compile()
        results = run_compiles(jobs)
    assert len(results) == len(jobs)
    bad = problems(jobs, results)
    assert not bad, f"{len(bad)} of {len(jobs)} specialisations fail:\n" + "\n".join(bad)
