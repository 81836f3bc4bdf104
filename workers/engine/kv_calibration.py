"""FP8 KV cache scales: one (k_scale, v_scale) per layer.

They are calibrated by running the float model on a fixed text shipped in this module (not the
evaluation text) and taking amax / 448 of each layer's K and V, rounded up to 4 significant bits
so that two workers computing them agree.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer

from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM
from workers.quantization.fp8 import FP8_MAX

# Calibration text for KV scales: plain English of several registers, written for this purpose.
# It must not be the text accuracy is measured on (pydoc topics), or the measurement would flatter.
CALIBRATION_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens, and wrote the weather in a leather notebook: wind from the north-west, "
    "light rain, visibility four miles. Ships passed in the night and never knew his name.\n\n"
    "To make bread, mix 500 g of flour with 350 ml of warm water, 10 g of salt and 7 g of yeast. "
    "Knead for ten minutes, let the dough rise for an hour, shape it, and bake at 230 degrees "
    "Celsius for about 35 minutes, until the crust is deep brown and sounds hollow when tapped.\n\n"
    "User: Can you explain what a hash table is?\nAssistant: A hash table stores key-value pairs. "
    "A hash function turns each key into an index in an array, so looking a key up takes constant "
    "time on average. Collisions, when two keys map to the same index, are resolved by chaining or "
    "by probing for the next free slot.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "In 1969, three astronauts flew to the Moon. Two of them walked on its surface for a few hours, "
    "collected rocks, planted a flag, and returned safely to Earth eight days after launch."
)
CALIBRATION_MAX_TOKENS = 512


def round_scale_up(x: float) -> float:
    """Round a positive scale up to 4 significant bits (m / 16 * 2^e).

    Two workers calibrating the same model may differ in the last bits (thread counts change
    summation order); coarse rounding makes their scales, and so their KV layouts, identical.
    Rounding up never makes the calibration data clip.
    """
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"scale must be finite and > 0, got {x!r}")
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(math.ceil(mantissa * 16) / 16, exponent)


def calibration_token_ids(model_dir: str | Path | None, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT through the model's tokenizer, or fixed pseudo-random ids without one."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is not None and path.is_file():
        ids = Tokenizer.from_file(str(path)).encode(CALIBRATION_TEXT).ids
        ids = [t for t in ids if 0 <= t < vocab_size]
    else:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (256,), generator=generator).tolist()
    return ids[:CALIBRATION_MAX_TOKENS]


@torch.inference_mode()
def calibrate_kv_scales(
    model: LlamaForCausalLM, token_ids: list[int], dtype: torch.dtype, block_size: int = 16
) -> tuple[tuple[float, float], ...]:
    """(k_scale, v_scale) per layer: amax / 448 of K and V over one float forward of token_ids.

    Runs on one thread so the result does not depend on the caller's thread count.
    """
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    cfg = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    device = model.embed_tokens.weight.device
    cache = torch.zeros(
        (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device
    )
    meta = AttentionMetadata.one_prompt(n, num_blocks, device)
    views = [KVCacheView(cache[layer, 0], cache[layer, 1]) for layer in range(cfg.num_layers)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), meta, views)
    finally:
        torch.set_num_threads(threads)
    amax = cache.float().abs().amax(dim=(2, 3, 4, 5))  # [L, 2]
    return tuple(
        (round_scale_up(max(float(k), 1e-6) / FP8_MAX), round_scale_up(max(float(v), 1e-6) / FP8_MAX))
        for k, v in amax.tolist()
    )
