"""Native CPU kernels: C++ sources in kernels/csrc/, compiled once per machine and loaded with ctypes.

The sources use a plain C ABI and no torch headers, so a build with the system C++ compiler
(`$CXX`, else `c++`) is quick. The library is cached under `$BATON_CACHE_DIR/kernels` (default
`~/.cache/baton/kernels`), keyed by the source, the flags, the compiler and the CPU (it is built
with -march=native). Without a compiler, or with an unwritable cache, `load()` returns None (with
a warning) and kernels.ops.kernel_ops() leaves the op on its PyTorch reference.

Threads: the kernels use OpenMP; torch ships libgomp under the same soname, so the process keeps
one OpenMP runtime and callers pass torch.get_num_threads().
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from common import envs

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# The parts of -ffast-math that let reductions and exp over a row vectorise (summation order is not
# bit-exact anyway), named one by one: -ffast-math itself (or -funsafe-math-optimizations) makes GCC
# link crtfastmath.o into a shared library, which turns on flush-to-zero for the whole process when
# the library loads, so torch and Python would lose subnormal floats. -ffinite-math-only stays off:
# masked attention scores rely on -inf.
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-freciprocal-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
    "-std=c++17",
)


def cache_dir() -> Path:
    return envs.cache_dir() / "kernels"


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=4)
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def compiler() -> str | None:
    return shutil.which(envs.cxx()) or shutil.which("g++") or shutil.which("clang++")


def build(name: str, directory: Path | None = None) -> ctypes.CDLL | None:
    """Compile kernels/csrc/{name}.cpp into `directory` (default cache_dir()), or find it there
    already built, and load it; None, with a warning, when that fails. Not memoised: see load()."""
    source = SOURCE_DIR / f"{name}.cpp"
    compiler_path = compiler()
    if compiler_path is None:
        log.warning("no C++ compiler found: the %s CPU kernel falls back to PyTorch", name)
        return None
    try:
        version = _compiler_version(compiler_path)
        headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]
        parts = [source.read_text(), *headers, " ".join(FLAGS), version, _cpu_identity()]
        target = (
            directory or cache_dir()
        ) / f"{name}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"
        if not target.exists():
            _compile(compiler_path, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:  # unwritable cache, failed build, unloadable library
        log.warning("the %s CPU kernel is unavailable (%s); falling back to PyTorch", name, exc)
        return None


def _compile(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.SubprocessError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled library for kernels/csrc/{name}.cpp, or None when it cannot be built; built
    (or found in the cache) once per process."""
    return build(name)


# Dtype codes the sources share (kernels/csrc/baton_cpu.h).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
I32, I64, F32, PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@functools.cache
def function(name: str, symbol: str, argtypes: tuple) -> Callable[..., int] | None:
    """`symbol` from kernels/csrc/{name}.cpp with its ctypes signature (it returns an int status),
    or None when the library cannot be built."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def address(name: str, symbol: str) -> int | None:
    """The address of `symbol` in kernels/csrc/{name}.cpp's library (for a native caller), or None
    when the library cannot be built."""
    lib = load(name)
    return None if lib is None else ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value


def build_all() -> dict[str, bool]:
    """Build (or find cached) every kernels/csrc/*.cpp library; name -> whether it loads."""
    return {src.stem: load(src.stem) is not None for src in sorted(SOURCE_DIR.glob("*.cpp"))}


if __name__ == "__main__":
    # `python -m kernels.cpu_native`: `make` runs this once so the first request does not pay the build.
    logging.basicConfig(level=logging.WARNING)
    results = build_all()
    for name, ok in results.items():
        print(f"native CPU kernel {name}: {'ready' if ok else 'unavailable, the PyTorch reference will run'}")
    print(f"cache: {cache_dir()}")
