"""KV transfer bandwidth between two processes: NCCL send/recv of a packed KV buffer.

Two processes (torch.multiprocessing, rendezvous on 127.0.0.1). With two or more GPUs each rank
gets its own; with one GPU both share it, which NCCL may refuse ("duplicate GPU"): the error
is recorded and a CUDA-IPC copy between the two processes is measured instead, labelled as such.
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.net import free_port
from kernels.block_copy import pack_kv_blocks, unpack_kv_blocks

# A transfer's payload: 64 blocks of a Llama-3-8B-like cache (32 layers, 8 kv heads, head_dim 128, block 16, bf16).
LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 32, 64, 16, 8, 128


def nccl_worker(rank: int, port: int, ngpu: int, iters: int, result_q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dev = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30), device_id=dev)
        # Both ranks build the same cache from one seed, so the receiver knows what must arrive.
        gen = torch.Generator(device=dev).manual_seed(0)
        cache = torch.randn(
            LAYERS, 2, 4 * BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen
        )
        ids = torch.arange(0, 4 * BLOCKS, 4, device=dev)
        expected = pack_kv_blocks(cache, ids)
        packed = expected.clone() if rank == 0 else torch.zeros_like(expected)
        nbytes = packed.numel() * packed.element_size()
        for i in range(iters + 3):
            if i == 3:  # three warm-up transfers
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
            if rank == 0:
                dist.send(packed, dst=1)
            else:
                dist.recv(packed, src=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ok = bool(torch.equal(packed, expected))
        if rank == 1:
            target = torch.zeros_like(cache)
            unpack_kv_blocks(target, ids, packed)
            ok = ok and bool(torch.equal(target[:, :, ids], cache[:, :, ids]))
        dist.destroy_process_group()
        result_q.put(
            {
                "rank": rank,
                "bytes": nbytes,
                "seconds": dt,
                "iters": iters,
                "GBps": nbytes * iters / dt / 1e9,
                "data_ok": ok,
            }
        )
    except Exception:
        result_q.put({"rank": rank, "error": traceback.format_exc()[-1500:]})


def run_nccl(ngpu: int, iters: int, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=nccl_worker, args=(r, port, ngpu, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    results, deadline = [], time.time() + timeout_s
    while len(results) < 2 and time.time() < deadline:
        try:
            results.append(q.get(timeout=max(0.1, deadline - time.time())))
        except Exception:
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    out = {"backend": "nccl", "gpus_used": min(ngpu, 2), "same_gpu": ngpu == 1, "ranks": results}
    if len(results) < 2:
        out["error"] = f"timed out after {timeout_s}s with {len(results)} of 2 ranks reporting"
    elif all("GBps" in r for r in results):
        out["GBps"] = min(r["GBps"] for r in results)
        out["data_ok"] = all(r["data_ok"] for r in results)
    else:
        out["error"] = " | ".join(r.get("error", "") for r in results)[-2000:]
    return out


def ipc_copy_child(handle_q, done_q, iters):
    try:
        src = handle_q.get(timeout=20)  # a CUDA tensor shared through CUDA IPC
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        nbytes = src.numel() * src.element_size()
        done_q.put({"bytes": nbytes, "GBps": nbytes * iters / dt / 1e9, "data_ok": bool(torch.equal(dst, src))})
    except Exception:
        done_q.put({"error": traceback.format_exc()[-1500:]})


def run_ipc(iters: int, timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    handle_q, done_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=ipc_copy_child, args=(handle_q, done_q, iters))
    child.start()
    try:
        src = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        handle_q.put(src)
        res = done_q.get(timeout=timeout_s)
    except Exception:
        res = {"error": traceback.format_exc()[-1500:]}
    child.join(timeout=timeout_s)
    if child.is_alive():
        child.kill()
    res["backend"] = "cuda-ipc copy (fallback: same process pair, one GPU)"
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ngpu = torch.cuda.device_count()
    report = {
        "payload": {
            "layers": LAYERS,
            "blocks": BLOCKS,
            "block_size": BLOCK_SIZE,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
        },
        "gpus": ngpu,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
    }
    report["nccl"] = run_nccl(ngpu, args.iters, timeout_s=40)
    print(json.dumps(report["nccl"], indent=2), flush=True)
    if "GBps" not in report["nccl"]:
        report["ipc"] = run_ipc(args.iters, timeout_s=20)
        print(json.dumps(report["ipc"], indent=2), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    ok = "GBps" in report["nccl"] or "GBps" in report.get("ipc", {})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
