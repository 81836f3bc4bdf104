"""Compile Triton kernels ahead of time for described GPU targets, without a GPU (a subprocess of
tests/kernels/test_compile_targets.py, run with TRITON_INTERPRET=0).

Reads one JSON job a line on stdin and answers each, as soon as it is compiled, with a line
RESULT_PREFIX + a JSON result on stdout (so the parent hands out the next job only then); ends
when stdin does:

    job:    {"id", "kernel": "module:function", "args": {name: triton type}, "constexprs": {...},
             "divisible": [arg names specialised as multiples of 16], "num_warps", "num_stages", "arch"}
    result: {"id", "ok", "error", "registers", "spill_bytes", "shared", "threads", "ptx_has": {...},
             "seconds"}

Registers and spills come from the ptxas log (`knobs.nvidia.dump_ptxas_log`, printed to stdout by
the compile, captured here); `always_compile` and a fresh TRITON_CACHE_DIR make every job compile.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import time
import warnings

PTX_MARKERS = ("wgmma", "tcgen05", "mma.sync")
RESULT_PREFIX = "AOT-RESULT "  # marks the answer lines among whatever else reaches stdout
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> tuple[int | None, int]:
    """(registers, spilled bytes: stores + loads) from a ptxas -v log."""
    regs = [int(m) for m in _REGS.findall(log)]
    spills = [int(a) + int(b) for a, b in _SPILL.findall(log)]
    return (max(regs) if regs else None), sum(spills)


def compile_job(job: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module, name = job["kernel"].split(":")
    raw = getattr(importlib.import_module(module), name)
    fn = JITFunction(getattr(raw, "fn", raw))
    # A constexpr the plan leaves out takes the kernel's default, as a launch does.
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    consts = {**defaults, **job["constexprs"]}
    signature = {a: ("constexpr" if a in consts else job["args"][a]) for a in fn.arg_names}
    divisible = set(job.get("divisible", ()))
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in divisible}
    options = {"num_warps": job["num_warps"]}
    if job.get("num_stages") is not None:
        options["num_stages"] = job["num_stages"]
    out = {
        "id": job["id"],
        "ok": False,
        "error": None,
        "registers": None,
        "spill_bytes": None,
        "shared": None,
        "threads": job["num_warps"] * 32,
        "ptx_has": {},
        "seconds": None,
    }
    buf = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            kernel = triton.compile(
                ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", job["arch"], 32), options=options
            )
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return out
    out["seconds"] = time.perf_counter() - started
    out["registers"], out["spill_bytes"] = parse_ptxas(buf.getvalue())
    out["shared"] = int(kernel.metadata.shared)
    out["threads"] = int(kernel.metadata.num_warps) * 32
    ptx = kernel.asm.get("ptx", "")
    out["ptx_has"] = {m: (m in ptx) for m in PTX_MARKERS}
    out["ok"] = out["registers"] is not None
    if not out["ok"]:
        out["error"] = "no ptxas log captured"
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET=0: the interpreter breaks real compiles")
    warnings.simplefilter("ignore")
    import triton

    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    while line := sys.stdin.readline():
        if line.strip():
            sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(compile_job(json.loads(line))) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
