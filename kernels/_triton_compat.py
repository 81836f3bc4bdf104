"""Late-bound Triton JIT, so that `TRITON_INTERPRET` is read at first launch, not at import.

Triton decides between compiling and interpreting when `triton.jit` decorates a function. The
engine may import the kernels long before a test sets `TRITON_INTERPRET=1`, so each kernel is
wrapped here and jitted on first use, once per interpreter setting. Importing this module never
fails when Triton is missing: the CPU references must keep working on machines without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import envs

# Triton ships no type information (no py.typed): mypy sees `triton` and `tl` as Any, here and
# in the kernel modules that import them from this one.
__all__ = ["HAS_TRITON", "LazyJIT", "cdiv", "interpreting", "lazy_jit", "next_pow2", "tl", "triton"]

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # macOS or a minimal install: references only
    HAS_TRITON = False

    class _MissingTriton:
        constexpr = None  # lets `x: tl.constexpr` annotations evaluate

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("triton is not installed; use kernel_backend='reference'")

    triton = tl = _MissingTriton()  # a stand-in that fails on use, not a module


def interpreting() -> bool:
    return envs.triton_interpret()


class LazyJIT:
    """`kernel[grid](...)` like a JITFunction, jitted at first launch for the current mode."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: dict[bool, Any] = {}  # interpreting -> Triton's JITFunction

    def __getitem__(self, grid: object) -> Callable[..., Any]:
        mode = interpreting()
        jitted = self._jitted.get(mode)
        if jitted is None:
            if not HAS_TRITON:
                raise RuntimeError("triton is not installed; use kernel_backend='reference'")
            jitted = triton.jit(self.fn)
            self._jitted[mode] = jitted
        return jitted[grid]


def lazy_jit(fn: Callable[..., None]) -> LazyJIT:
    return LazyJIT(fn)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
