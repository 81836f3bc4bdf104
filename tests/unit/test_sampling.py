"""Sampler, sampling parameters and incremental detokenization against hand-computed expectations."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from common.block_hash import hash_prefix_blocks
from common.detokenizer import IncrementalDetokenizer
from common.sampling_params import SamplingParams
from workers.engine.sampler import SamplingRow, sample


def row(params: SamplingParams, seed: int | None = None, outputs=None) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, outputs or [], [], gen)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_k", -3),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", "x"),
        ("min_tokens", 99),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample(
        logits, [row(SamplingParams(temperature=0.0, logprobs=2)), row(SamplingParams(temperature=0.0))]
    )
    assert tokens == [1, 0]
    expected = logits[0] - torch.logsumexp(logits[0], 0)
    assert math.isclose(logprobs[0].logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in logprobs[0].top] == [1, 3]
    assert logprobs[1] is None


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k, seen_p = set(), set()
    for seed in range(300):
        seen_k |= set(sample(logits, [row(SamplingParams(top_k=2), seed)])[0])
        # top_p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it, so tokens 0 and 1 remain.
        seen_p |= set(sample(logits, [row(SamplingParams(top_p=0.7), seed)])[0])
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}


def test_same_seed_same_tokens_regardless_of_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=11)
    alone = [sample(logits[1:2], [row(params, 11)])[0][0] for _ in range(1)]
    batched = sample(logits, [row(SamplingParams(), 5), row(params, 11), row(SamplingParams(temperature=0.0))])[0]
    assert alone[0] == batched[1]


def test_penalties_follow_openai_formulas():
    logits = torch.tensor([[2.0, 2.0, 2.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.4)
    # Token 0 appeared twice: 2 - 2*0.5 - 0.4 = 0.6 < 2, so token 1 or 2 wins; token 1 once: 1.1.
    assert sample(logits, [row(params, outputs=[0, 0, 1])])[0] == [2]


def test_detokenizer_cuts_stop_strings_and_holds_back_partial_matches():
    vocab = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    detok = IncrementalDetokenizer(decode, stop=["world"])
    pieces = []
    out: list[int] = []
    for tok in (1, 2, 3, 4, 5):
        out.append(tok)
        detok.add(out)
        pieces.append(detok.take(final=detok.stopped))
        if detok.stopped:
            break
    assert "".join(pieces) == "Hello "
    assert detok.stopped


def test_detokenizer_waits_for_complete_utf8():
    # Byte-level tokens: "é" is two bytes split across two tokens.
    vocab = {1: b"caf", 2: b"\xc3", 3: b"\xa9"}

    def decode(ids):
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(decode)
    deltas = []
    for n in range(1, 4):
        detok.add([1, 2, 3][:n])
        deltas.append(detok.take(final=n == 3))
    assert deltas == ["caf", "", "é"]


def test_block_hashes_are_chained_and_stable_across_processes():
    tokens = list(range(100))
    here = hash_prefix_blocks(tokens, 16)
    assert len(here) == 6  # the trailing 4 tokens form no full block
    assert hash_prefix_blocks(tokens[:48], 16) == here[:3]
    changed = hash_prefix_blocks([999] + tokens[1:], 16)
    assert all(a != b for a, b in zip(here, changed))  # a change in block 0 changes every later hash
    code = "from common.block_hash import hash_prefix_blocks; print(hash_prefix_blocks(list(range(100)), 16))"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    ).stdout
    assert other.strip() == str(here)
