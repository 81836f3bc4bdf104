"""Gemma 2 / Gemma 3 (text) and sliding-window attention against transformers, and the block
manager releasing blocks that fall out of a window.

The tiny models are real Gemma 2 (gemma-2-2b) and Gemma 3 (gemma-3-1b) configurations shrunk: 4
layers, hidden 64, vocab 512, head_dim 64 with query_pre_attn_scalar = head_dim, a sliding window of
16 tokens (shorter than every prompt, so the window matters) and the families' layer patterns
(Gemma 2 alternates sliding and global layers; Gemma 3 has sliding layers before a global one and
rope bases 10k local / 1M global). Gemma 2's soft-caps are lowered from 50 / 30 to values the tiny
model's logits reach, so that capping changes the outputs (checked). Float32 greedy tokens must
equal transformers' generate, logits within 1e-3 before any near tie (tests.engine.helpers).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from common.protocol import KVLayout, KVLayoutMismatch
from common.sampling_params import SamplingParams
from tests.engine.helpers import compare_greedy, hf_greedy, interpreter_ready, run_with_logits, save_tiny_model
from workers.build import build_engine
from workers.config import EngineConfig
from workers.engine.block_manager import FREED_BLOCK
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.files import ModelNotFoundError, check_model_dir

pytestmark = pytest.mark.slow  # tiny Gemmas against transformers, Triton kernels interpreted too: about 14 s here

WINDOW = 16
SHRUNK = dict(
    num_hidden_layers=4,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=WINDOW,
    tie_word_embeddings=True,
)
GEMMA_CASES = {
    "gemma2": dict(
        SHRUNK,
        num_key_value_heads=2,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "gemma3": dict(SHRUNK, num_key_value_heads=1, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
}
NEW_TOKENS = 12


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _check_all(completions, refs, logits) -> None:
    for c, r, lg in zip(completions, refs, logits):
        compare_greedy(c.token_ids, r, lg)


@pytest.fixture(scope="module", params=list(GEMMA_CASES))
def gemma(request):
    kind = request.param
    folder, hf = save_tiny_model(kind, **GEMMA_CASES[kind])
    return kind, folder, hf


def test_gemma_config_reads_the_family(gemma):
    kind, folder, _ = gemma
    config = ModelConfig.from_model_dir(folder)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 64
    if kind == "gemma2":
        assert config.layer_windows == (WINDOW, None, WINDOW, None)
        assert (config.attn_logit_softcap, config.final_logit_softcap) == (1.5, 2.0)
        assert config.local_rope_theta is None and not config.qk_norm
    else:
        assert config.layer_windows == (WINDOW, WINDOW, WINDOW, None)
        assert config.attn_logit_softcap is None and config.final_logit_softcap is None
        assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0) and config.qk_norm
    assert config.kv_window is None  # a global layer keeps every block


def test_gemma_greedy_matches_transformers(gemma):
    kind, folder, hf = gemma
    config = ModelConfig.from_model_dir(folder)
    engine = build_engine(config, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=512), iter_safetensors(folder))
    prompts = _prompts(11, (17, 20, 31, 33, 48, 64, 65, 90, 120, 150))  # all longer than the window
    completions, logits = run_with_logits(
        engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    _check_all(completions, refs, logits)


def test_gemma_oracle_depends_on_window_and_caps(gemma):
    """The test above can fail: the window (and Gemma 2's caps) change transformers' logits."""
    kind, folder, hf = gemma
    prompt = torch.tensor([_prompts(5, (80,))[0]])
    with torch.inference_mode():
        base = hf(prompt).logits[0, -1]
        variants = {"sliding_window": 4096}
        if kind == "gemma2":
            variants.update(attn_logit_softcapping=None, final_logit_softcapping=None)
        for name, value in variants.items():
            old = getattr(hf.config, name)
            setattr(hf.config, name, value)
            for layer in hf.model.layers:  # the attention modules copy these at construction
                if name == "sliding_window" and layer.self_attn.sliding_window is not None:
                    layer.self_attn.sliding_window = value
                if name == "attn_logit_softcapping":
                    layer.self_attn.attn_logit_softcapping = value
            try:
                changed = float((hf(prompt).logits[0, -1] - base).abs().max())
            finally:
                setattr(hf.config, name, old)
                for layer in hf.model.layers:
                    if name == "sliding_window" and layer.self_attn.sliding_window is not None:
                        layer.self_attn.sliding_window = old
                    if name == "attn_logit_softcapping":
                        layer.self_attn.attn_logit_softcapping = old
            assert changed > 1e-2, f"{name} does not change the oracle's logits ({changed:.1e})"


def test_gemma_chunked_prefill_and_prefix_cache_match_transformers(gemma):
    kind, folder, hf = gemma
    config = ModelConfig.from_model_dir(folder)
    # Chunks of 24 tokens (not a block multiple, longer than the window) and a shared 40-token prefix.
    engine = build_engine(config, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=24), iter_safetensors(folder))
    prefix = _prompts(3, (40,))[0]
    prompts = [prefix + tail for tail in _prompts(4, (1, 9, 30, 57))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first, first_logits = run_with_logits(engine, prompts[:1], params)
    rest, rest_logits = run_with_logits(engine, prompts[1:], params)
    assert engine.block_manager.prefix_hits >= 3 * 32  # each later prompt reused the prefix's 2 full blocks
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    _check_all(first + rest, refs, first_logits + rest_logits)


# ---- sliding windows in the block manager (Mistral-style: every layer windowed) ------------------

MISTRAL = dict(sliding_window=32, num_hidden_layers=2, head_dim=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mistral():
    return save_tiny_model("mistral", **MISTRAL)


def test_all_windowed_long_request_keeps_only_the_window_blocks(mistral):
    folder, hf = mistral
    config = ModelConfig.from_model_dir(folder)
    assert config.layer_windows == (32, 32) and config.kv_window == 32
    bs, num_blocks = 16, 64
    engine = build_engine(
        config,
        EngineConfig(num_kv_blocks=num_blocks, max_num_batched_tokens=64, block_size=bs),
        iter_safetensors(folder),
    )
    prompt = _prompts(8, (300,))[0]  # ~10x the window
    new_tokens = 40
    rid = engine.add_request(prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    tokens, held = [], []
    while engine.has_unfinished_requests():
        seq = next((s for s in engine.scheduler.running if s.request_id == rid), None)
        for out in engine.step():
            tokens.extend(out.token_ids)
        if seq is not None and seq.block_ids:
            n = seq.num_computed_tokens
            live = [b for b in seq.block_ids if b != FREED_BLOCK]
            # Blocks from the one holding the next query's first visible key (n - 32 + 1) to the last.
            expected = -(-n // bs) - max(0, n - 32 + 1) // bs
            assert len(live) == expected, (n, len(live), expected)
            assert engine.block_manager.num_free_blocks == num_blocks - len(live)
            held.append(len(live))
    assert max(held) <= 3 and len(held) >= new_tokens  # 32 tokens span at most 3 blocks of 16
    with torch.inference_mode():
        ref = hf_greedy(hf, prompt, new_tokens)
    compare_greedy(tokens, ref)
    engine.scheduler.check_invariants()


def test_windowed_prefix_reuse_across_requests_is_exact(mistral):
    folder, hf = mistral
    config = ModelConfig.from_model_dir(folder)
    engine = build_engine(config, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48), iter_safetensors(folder))
    base = _prompts(9, (200,))[0]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # The first request releases its early blocks as it goes (they stay cached); the second
    # shares its first 160 tokens and must get the same answer as transformers from them.
    prompts = [base, base[:160] + _prompts(10, (25,))[0]]
    first, first_logits = run_with_logits(engine, prompts[:1], params)
    hits_before = engine.block_manager.prefix_hits
    second, second_logits = run_with_logits(engine, prompts[1:], params)
    assert engine.block_manager.prefix_hits - hits_before == 160
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    _check_all(first + second, refs, first_logits + second_logits)
    engine.scheduler.check_invariants()


def test_an_evicted_block_breaks_the_prefix_hit(mistral):
    """A cached block that was reused for other KV is no hit, nor is anything after it."""
    folder, _ = mistral
    config = ModelConfig.from_model_dir(folder)
    engine = build_engine(config, EngineConfig(num_kv_blocks=16, max_num_batched_tokens=64), iter_safetensors(folder))
    base = _prompts(12, (100,))[0]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([base], params)
    engine.generate(_prompts(13, (240,)), params)  # cycles through every free block: the first prompt's are reused
    hits_before = engine.block_manager.prefix_hits
    engine.generate([base], params)
    assert engine.block_manager.prefix_hits == hits_before


# ---- config parsing and the family check -------------------------------------------------------


def _config_dict(folder: str) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def test_transformers4_style_gemma_configs_get_their_layer_patterns(gemma):
    kind, folder, _ = gemma
    config = _config_dict(folder)
    config.pop("layer_types")
    if kind == "gemma2":  # 4.x: even layers slide
        assert ModelConfig.from_dict(config).layer_windows == (WINDOW, None, WINDOW, None)
    else:  # 4.x: sliding_window_pattern and rope_local_base_freq, rope_theta global
        rope = config.pop("rope_parameters")
        config.update(
            sliding_window_pattern=2, rope_theta=rope["full_attention"]["rope_theta"], rope_local_base_freq=5000.0
        )
        parsed = ModelConfig.from_dict(config)
        assert parsed.layer_windows == (WINDOW, None, WINDOW, None)
        assert (parsed.rope_theta, parsed.local_rope_theta) == (1_000_000.0, 5000.0)


def test_qwen2_sliding_layers_and_unknown_layer_types(mistral):
    folder, _ = mistral
    config = _config_dict(folder)
    config.update(architectures=["Qwen2ForCausalLM"], layer_types=None, use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_dict(config).layer_windows == (None, 32)
    config.update(layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelConfig.from_dict(config)
    config.update(architectures=["MistralForCausalLM"], layer_types=None, sliding_window=4096)
    assert ModelConfig.from_dict(config).layer_windows == ()  # a window past the context is no window


def test_unsupported_family_is_refused_listing_the_supported_ones(mistral, tmp_path):
    folder, _ = mistral
    config = dict(_config_dict(folder), architectures=["GPTNeoXForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError, match="Gemma2ForCausalLM.*Gemma3ForCausalLM"):
        check_model_dir(tmp_path)
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_dict(config)


def test_kv_layout_handshake_names_the_window_field():
    common = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    windowed = KVLayout(**common, layer_windows=(32, None))
    assert KVLayout(**common, layer_windows=(None, None)).layer_windows == ()
    windowed.check_compatible(KVLayout(**common, layer_windows=(32, None)))
    with pytest.raises(KVLayoutMismatch, match="layer_windows"):
        windowed.check_compatible(KVLayout(**common))
    with pytest.raises(ValueError, match="layer_windows"):
        KVLayout(**common, layer_windows=(32,))


def test_block_manager_releases_a_leading_run_and_frees_the_rest():
    """Hand-computed: window 20, blocks of 8. After 30 computed tokens the next query (position 30)
    sees positions 11..30, so blocks 0 (0-7) is released and block 1 (8-15) kept."""
    from workers.engine.block_manager import BlockManager
    from workers.engine.sequence import Sequence

    bm = BlockManager(num_blocks=8, block_size=8, enable_prefix_caching=True, window=20)
    seq = Sequence("r", list(range(100, 140)), SamplingParams(max_tokens=4))
    assert bm.allocate_prefix_and_new(seq, [], 30)
    seq.num_computed_tokens = 30
    bm.cache_computed_blocks(seq)
    assert bm.release_out_of_window(seq) == 1 and seq.block_ids[0] == FREED_BLOCK
    assert bm.release_out_of_window(seq) == 0  # idempotent
    bm.check_invariants({b: 1 for b in seq.block_ids if b != FREED_BLOCK})
    assert bm.num_free_blocks == 8 - 3
    # The released full block stays in the prefix cache: a new prompt sharing it hits it.
    again = Sequence("s", list(range(100, 140)), SamplingParams(max_tokens=4))
    assert len(bm.find_cached_prefix(again)) == 3
    bm.free(seq)
    bm.check_invariants({})
    assert bm.num_free_blocks == 8
    assert BlockManager(4, 8).release_out_of_window(again) == 0  # no window: nothing released


# ---- the Triton kernels in the model (interpreted on the CPU) ----------------------------------------


def triton_path_child(kind: str) -> None:
    """Run where Triton was imported with TRITON_INTERPRET=1 (this session, or a child started with it):
    the tiny Gemma on kernel_backend "triton" (windowed and soft-capped attention, GeGLU) against
    transformers, with chunked prefill."""
    folder, hf = save_tiny_model(kind, **GEMMA_CASES[kind])
    engine = build_engine(
        ModelConfig.from_model_dir(folder),
        EngineConfig(num_kv_blocks=64, max_num_batched_tokens=24, kernel_backend="triton"),
        iter_safetensors(folder),
    )
    assert engine.runner.ops.backend == "triton"
    prompts = _prompts(11, (20, 45))
    completions, logits = run_with_logits(
        engine, prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 6) for p in prompts]
    _check_all(completions, refs, logits)


@pytest.mark.parametrize("kind", list(GEMMA_CASES))
def test_gemma_on_the_triton_kernels_matches_transformers(kind):
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    if interpreter_ready():  # the session's Triton interprets (tests/conftest.py): no child needed
        triton_path_child(kind)
        return
    repo = Path(__file__).resolve().parents[2]
    code = f"from tests.engine.test_gemma_and_windows import triton_path_child; triton_path_child({kind!r})"
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)},
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
