"""Sampling by the exponential race: one token per row of logits, the whole batch in one pass.

For independent E_i ~ Exp(1), argmax_i p_i / E_i is token i with probability p_i / sum(p) (the
first arrival of independent Poisson clocks with rates p_i), so no row needs a normalised
distribution, a cumulative sum or a sort, and tokens cut to -inf never win. Here
p_i = exp((x_i - max x) * inv_temperature), so the race draws from softmax(x / temperature).

The noise is a function of one 64-bit key per row (counter-based: SplitMix64's output function of
key + (i + 1) * golden, top 32 bits, w = (bits + 0.5) / 2^32, E = -log1p(-w)). Callers draw a
seeded request's key from its own torch.Generator, so its token depends on its key and its logits
alone, never on the rows batched with it. Both implementations draw exactly this noise and score
in double, so they pick the same token:

- `exponential_race_reference`: PyTorch, any device; materialises the noise ([rows, vocab] float64).
- `exponential_race_cpu`: kernels/csrc/exponential_race.cpp; scores exactly only the few tokens a
  cheap float test cannot rule out (E_i >= w_i), so most of the vocabulary costs a hash and a compare.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels._checks import check_last_dim_contiguous, check_tensor, require

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
# The counters of retry r are key + (i + 1 + r * 2^32) * golden: disjoint from the first draw's for
# any vocabulary under 2^32 tokens.
RETRY_STRIDE = (GOLDEN << 32) & MASK64


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _lsr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def retry_keys(keys: torch.Tensor, attempt: int) -> torch.Tensor:
    """Keys for a row's `attempt`-th fresh race this step, from its one key: noise independent of
    every earlier attempt's (rejection sampling for top-p uses them)."""
    return keys + _signed(attempt * RETRY_STRIDE) if attempt else keys


def race_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms w in (0, 1) both implementations draw: float64 [rows, vocab]."""
    i = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    # int64 products wrap modulo 2^64, which is the unsigned arithmetic of the C++ kernel.
    z = keys.to(torch.int64)[:, None] + i[None, :] * _signed(GOLDEN)
    z = (z ^ _lsr(z, 30)) * _signed(MIX1)
    z = (z ^ _lsr(z, 27)) * _signed(MIX2)
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 32).double() + 0.5) * 2.0**-32


def _check(logits, inv_temperature, keys, cuts) -> None:
    check_tensor(logits, "logits", 2, (torch.float32,))
    check_tensor(inv_temperature, "inv_temperature", 1, (torch.float32,))
    check_tensor(keys, "keys", 1, (torch.int64,))
    rows = logits.shape[0]
    require(
        inv_temperature.shape[0] == rows and keys.shape[0] == rows,
        f"inv_temperature ({inv_temperature.shape[0]}) and keys ({keys.shape[0]}) need one entry per row ({rows})",
    )
    for name, cut in cuts.items():
        if cut is not None:
            check_tensor(cut, name, 1, (torch.float32,))
            require(cut.shape[0] == rows, f"{name} has {cut.shape[0]} entries for {rows} rows")
    require(logits.shape[1] > 0, "logits must have at least one column")


def exponential_race_reference(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    top_k_floor: torch.Tensor | None = None,
    min_p_offset: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    attempts: int = 1,
) -> torch.Tensor:
    """int64 [rows]: per row, the token drawn from softmax(logits * inv_temperature) after the cuts,
    -1 for a top-p row none of whose `attempts` races landed in its nucleus.

    Cuts (float32 [rows] each, None for none): tokens below top_k_floor (the k-th largest logit) are
    out of the distribution; the race runs over the tokens at or above max + min_p_offset too
    (min_p_offset = temperature * log(min_p): min-p is p >= min_p * max p); a token drawn for a
    top_p row (1.0: no cut) is kept when the tokens above it hold under top_p of the mass the
    top-k cut left, which is membership of the nucleus the sorted cut keeps; else the row races
    again with the next attempt's keys (retry_keys). Drawing from p and keeping only nucleus tokens
    draws from p restricted to the nucleus.
    """
    _check(logits, inv_temperature, keys, {"top_k_floor": top_k_floor, "min_p_offset": min_p_offset, "top_p": top_p})
    rows, vocab = logits.shape
    if rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device)
    neg_inf = torch.full((rows,), float("-inf"), device=logits.device)
    k_floor = neg_inf if top_k_floor is None else top_k_floor
    m = logits.amax(-1)
    # float32 sums, as the kernel: max + offset, then the larger of the two floors.
    floor = torch.maximum(k_floor, m + min_p_offset) if min_p_offset is not None else k_floor
    x = logits.double()
    weight = ((x - m.double()[:, None]) * inv_temperature.double()[:, None]).exp()
    in_dist = logits >= k_floor[:, None]
    racing = torch.where(logits >= floor[:, None], weight, 0.0)
    out = (racing / -torch.log1p(-race_uniforms(keys, vocab))).argmax(-1)
    if top_p is None:
        return out
    cut = top_p < 1.0
    total = torch.where(in_dist, weight, 0.0).sum(-1)
    pending = cut.clone()
    for attempt in range(attempts):
        if attempt:
            drawn = (racing / -torch.log1p(-race_uniforms(retry_keys(keys, attempt), vocab))).argmax(-1)
            out = torch.where(pending, drawn, out)
        above = torch.where(in_dist & (logits > logits.gather(1, out[:, None])), weight, 0.0).sum(-1)
        pending &= ~(above < top_p.double() * total)
        if not bool(pending.any()):
            return out
    return torch.where(pending, torch.full_like(out, -1), out)


_NATIVE_ARGS = (
    cpu_native.PTR,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.I64,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.PTR,
    cpu_native.I32,
    cpu_native.PTR,
    cpu_native.I32,
)


def _native_fn():
    return cpu_native.function("exponential_race", "baton_exponential_race", _NATIVE_ARGS)


def native_built() -> bool:
    """Whether the native library loads on this machine (built, or found cached, once per process)."""
    return _native_fn() is not None


def native_available(logits, *rest, **kwargs) -> bool:
    """Whether exponential_race_cpu handles these logits (CPU float32, built library)."""
    return (
        isinstance(logits, torch.Tensor)
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and _native_fn() is not None
    )


def exponential_race_cpu(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    top_k_floor: torch.Tensor | None = None,
    min_p_offset: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    attempts: int = 1,
) -> torch.Tensor:
    """The native CPU kernel; same contract and the same tokens as the reference (its top-p sums
    run in float lanes: a token whose mass above sits within ~1e-6 of top_p may be judged apart)."""
    cuts = {"top_k_floor": top_k_floor, "min_p_offset": min_p_offset, "top_p": top_p}
    _check(logits, inv_temperature, keys, cuts)
    require(native_available(logits), f"no native CPU exponential race for {logits.dtype} on {logits.device}")
    require(isinstance(attempts, int) and attempts >= 1, f"attempts must be an integer >= 1, got {attempts!r}")
    check_last_dim_contiguous(logits, "logits")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        args = [
            t.contiguous() if t is not None else None for t in (inv_temperature, keys, top_k_floor, min_p_offset, top_p)
        ]
        ptrs = [t.data_ptr() if t is not None else None for t in args]
        stride = logits.stride(0) if rows > 1 else vocab  # a single row's stride is arbitrary
        err = _native_fn()(
            logits.data_ptr(), stride, rows, vocab, *ptrs, attempts, out.data_ptr(), torch.get_num_threads()
        )
        require(err == 0, f"native exponential race failed with status {err}")
    return out
