"""The batched sampler draws from the distribution the sampling parameters define, and seeds hold.

The oracle is written out here in float64 from the definitions (temperature, then top-k, top-p
as the smallest sorted prefix reaching top_p, min-p relative to the top probability; OpenAI's
presence/frequency penalties and the repetition penalty), independent of workers/engine/sampler.py.
Each case draws N tokens (N identical rows of one batch: unseeded rows get independent keys) and
runs a chi-square goodness-of-fit test at significance 1e-6, so a correct sampler fails one case
about once in a million seeds; with the fixed generator seed the outcome is deterministic. A token
the oracle gives probability 0 must never be drawn. Both race kernels (the PyTorch reference and
the native CPU one) are checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels import sampling
from workers.engine.sampler import RACE_ATTEMPTS, SamplingRow, sample

pytestmark = pytest.mark.slow  # thousands of draws per case against the reference distributions: about 10 s here

N = 40_000
ALPHA = 1e-6

RACES = [
    pytest.param(sampling.exponential_race_reference, id="reference"),
    pytest.param(
        sampling.exponential_race_cpu,
        id="native",
        marks=pytest.mark.skipif(not sampling.native_built(), reason="no C++ compiler"),
    ),
]

# Distinct logits over a small vocabulary (distinct so the sorted top-p cut has no ties).
LOGITS = [2.0, 1.6, 1.1, 0.9, 0.5, 0.2, -0.1, -0.4, -0.8, -1.3, -1.9, -2.6]


def oracle(logits: list[float], p: SamplingParams, prompt=(), output=()) -> list[float]:
    x = list(map(float, logits))
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    x = [v / p.temperature for v in x]
    keep = set(range(len(x)))
    if p.top_k:
        keep = set(sorted(keep, key=lambda t: -x[t])[: p.top_k])

    def probs(kept):
        m = max(x[t] for t in kept)
        e = {t: math.exp(x[t] - m) for t in kept}
        z = sum(e.values())
        return {t: v / z for t, v in e.items()}

    if p.top_p < 1.0:
        pr, mass, nucleus = probs(keep), 0.0, set()
        for t in sorted(keep, key=lambda t: -pr[t]):
            if mass >= p.top_p:
                break
            nucleus.add(t)
            mass += pr[t]
        keep = nucleus
    if p.min_p > 0.0:
        pr = probs(keep)
        top = max(pr.values())
        keep = {t for t in keep if pr[t] >= p.min_p * top}
    pr = probs(keep)
    return [pr.get(t, 0.0) for t in range(len(x))]


def chi_square_p_value(counts: list[int], expected: list[float]) -> float:
    """Upper tail of the chi-square statistic over the tokens with expected probability > 0."""
    n = sum(counts)
    cells = [(c, e * n) for c, e in zip(counts, expected) if e > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof == 0:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def draw(
    race, logits: list[float], params: SamplingParams, n: int = N, prompt=(), output=(), seed: int = 0
) -> list[int]:
    rows = [SamplingRow(params, list(output), list(prompt), None) for _ in range(n)]
    batch = torch.tensor([logits], dtype=torch.float32).expand(n, -1).contiguous()
    tokens, _ = sample(batch, rows, torch.Generator().manual_seed(seed), race)
    return tokens


def assert_same_distribution(tokens: list[int], expected: list[float]) -> None:
    counts = [0] * len(expected)
    for t in tokens:
        counts[t] += 1
    forbidden = {t: c for t, c in enumerate(counts) if c and expected[t] == 0.0}
    assert not forbidden, f"drew tokens the parameters cut: {forbidden}"
    p_value = chi_square_p_value(counts, expected)
    assert p_value > ALPHA, (
        f"counts {counts} vs expected {[round(e * len(tokens)) for e in expected]}: p = {p_value:.2e}"
    )


CASES = {
    "temperature 1": SamplingParams(),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 1.7": SamplingParams(temperature=1.7),
    "top-k 3": SamplingParams(top_k=3),
    "top-p 0.7": SamplingParams(top_p=0.7),
    "top-p 0.95, temperature 0.8": SamplingParams(top_p=0.95, temperature=0.8),
    "min-p 0.2": SamplingParams(min_p=0.2),
    "top-k 6 + top-p 0.8 + min-p 0.1": SamplingParams(top_k=6, top_p=0.8, min_p=0.1, temperature=1.3),
}


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("name", list(CASES))
def test_cuts_draw_from_the_reference_distribution(race, name):
    params = CASES[name]
    assert_same_distribution(draw(race, LOGITS, params), oracle(LOGITS, params))


@pytest.mark.parametrize("race", RACES)
def test_penalties_draw_from_the_reference_distribution(race):
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, temperature=0.9)
    prompt, output = (0, 2, 9), (1, 1, 1, 4, 9, 10)
    tokens = draw(race, LOGITS, params, prompt=prompt, output=output)
    assert_same_distribution(tokens, oracle(LOGITS, params, prompt, output))


@pytest.mark.parametrize("race", RACES)
def test_a_tiny_nucleus_of_a_flat_distribution_rejects_often_and_stays_exact(race):
    # Acceptance per race is ~0.19 here, so many rows run out of rejection rounds and take the sorted cut.
    flat = [0.05 * (12 - i) for i in range(12)]
    params = SamplingParams(top_p=0.15)
    expected = oracle(flat, params)
    full = oracle(flat, SamplingParams())
    accept = sum(full[t] for t, e in enumerate(expected) if e > 0)
    assert sum(e > 0 for e in expected) == 2 and (1 - accept) ** RACE_ATTEMPTS > 0.1  # the fallback is exercised
    assert_same_distribution(draw(race, flat, params), expected)


@pytest.mark.parametrize("race", RACES)
def test_rows_with_different_parameters_in_one_batch_each_follow_their_own(race):
    configs = list(CASES.values()) + [SamplingParams(temperature=0.0)]
    per = 6_000
    params = [configs[i % len(configs)] for i in range(per * len(configs))]
    rows = [SamplingRow(p, [], [], None) for p in params]
    batch = torch.tensor([LOGITS], dtype=torch.float32).expand(len(rows), -1).contiguous()
    tokens, _ = sample(batch, rows, torch.Generator().manual_seed(3), race)
    for c, p in enumerate(configs):
        mine = tokens[c :: len(configs)]
        if p.greedy:
            assert set(mine) == {0}
        else:
            assert_same_distribution(mine, oracle(LOGITS, p))


def test_banned_tokens_are_never_drawn_and_the_rest_keep_their_ratios():
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, [], [], None, banned_token_ids=(0, 3)) for _ in range(N)]
    batch = torch.tensor([LOGITS], dtype=torch.float32).expand(N, -1).contiguous()
    tokens, _ = sample(batch, rows, torch.Generator().manual_seed(5))
    without = [v if t not in (0, 3) else float("-inf") for t, v in enumerate(LOGITS)]
    m = max(without)
    e = [math.exp(v - m) for v in without]
    assert_same_distribution(tokens, [v / sum(e) for v in e])


# ---- seeds ---------------------------------------------------------------------------------------


def run_steps(logits_per_step: list[torch.Tensor], rows: list[SamplingRow], race, position: int) -> list[int]:
    """Sample every step for the whole batch; return the tokens of row `position`."""
    generator = torch.Generator().manual_seed(99)
    mine = []
    for logits in logits_per_step:
        tokens, _ = sample(logits[: len(rows)], rows, generator, race)
        for row, tok in zip(rows, tokens):
            row.output_token_ids.append(tok)
        mine.append(tokens[position])
    return mine


@pytest.mark.parametrize("race", RACES)
def test_a_seeded_request_gets_the_same_tokens_alone_and_in_any_batch(race):
    vocab, steps = 300, 12
    g = torch.Generator().manual_seed(1)
    logits_per_step = [torch.randn(6, vocab, generator=g) * 2 for _ in range(steps)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1, seed=1234)

    def row(p):
        return SamplingRow(p, [], [7, 8, 9], torch.Generator().manual_seed(p.seed) if p.seed is not None else None)

    alone = run_steps([step[[2]] for step in logits_per_step], [row(seeded)], race, 0)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, seed=5),
        SamplingParams(presence_penalty=1.0, min_p=0.3),
        SamplingParams(top_k=3, temperature=2.0),
    ]
    batch = [row(p) for p in others[:2]] + [row(seeded)] + [row(p) for p in others[2:]]
    assert run_steps(logits_per_step, batch, race, 2) == alone
    reordered = [row(seeded)] + [row(p) for p in others]
    assert run_steps([step[[2, 0, 1, 3, 4, 5]] for step in logits_per_step], reordered, race, 0) == alone
    # A different seed takes a different path (12 steps over a wide distribution).
    other_seed = SamplingParams(**{**seeded.__dict__, "seed": 4321})
    assert run_steps([step[[2]] for step in logits_per_step], [row(other_seed)], race, 0) != alone


def test_both_race_kernels_pick_the_same_tokens_for_the_same_keys():
    if not sampling.native_built():
        pytest.skip("no C++ compiler")
    g = torch.Generator().manual_seed(2)
    for vocab in (1, 15, 16, 17, 1000, 49_152):
        x = torch.randn(24, vocab, generator=g) * 4
        x[::3, ::5] = float("-inf")
        x[:, 0] = 0.0  # no row is fully masked
        inv_t = torch.rand(24, generator=g) * 4 + 0.05
        keys = torch.empty(24, dtype=torch.int64).random_(generator=g)
        assert (
            sampling.exponential_race_cpu(x, inv_t, keys).tolist()
            == sampling.exponential_race_reference(x, inv_t, keys).tolist()
        )
        # With every cut, on some rows each; two attempts, so some top-p rows miss (-1) in both.
        k = torch.randint(1, vocab + 1, (24,), generator=g)
        k_floor = torch.where(
            torch.arange(24) % 2 == 0,
            x.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])[:, 0],
            float("-inf"),
        )
        offset = torch.where(torch.arange(24) % 3 == 0, torch.rand(24, generator=g).log() / inv_t, float("-inf"))
        top_p = torch.where(torch.arange(24) % 4 < 2, torch.rand(24, generator=g) * 0.5, 1.0)
        cuts = (k_floor, offset, top_p, 2)
        native = sampling.exponential_race_cpu(x, inv_t, keys, *cuts)
        assert native.tolist() == sampling.exponential_race_reference(x, inv_t, keys, *cuts).tolist()
        assert vocab < 100 or (native == -1).any()


def test_race_noise_is_uniform_and_keys_decorrelate():
    keys = torch.tensor([0, 1, 2, -1], dtype=torch.int64)
    w = sampling.race_uniforms(keys, 50_000)
    assert 0.0 < float(w.min()) and float(w.max()) < 1.0
    for row in w:
        # Mean and variance of U(0, 1) within 6 standard errors; neighbouring keys are unrelated.
        assert abs(float(row.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / len(row))
        assert abs(float(row.var()) - 1 / 12) < 0.005
    corr = torch.corrcoef(w)
    assert float((corr - torch.eye(4, dtype=torch.float64)).abs().max()) < 6 / math.sqrt(50_000)
    # Retry keys give fresh noise too.
    again = sampling.race_uniforms(sampling.retry_keys(keys[:1], 1), 50_000)[0]
    assert abs(float(torch.corrcoef(torch.stack([w[0], again]))[0, 1])) < 6 / math.sqrt(50_000)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 100, generator=g)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], None) for _ in range(4)] + [
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [5], [1, 2], None) for _ in range(4)
    ]
    tokens, _ = sample(logits.clone(), rows, g)
    assert tokens[:4] == logits[:4].argmax(-1).tolist()
    penalised = logits[4:].clone()
    for t in (1, 2, 5):
        penalised[:, t] = torch.where(penalised[:, t] > 0, penalised[:, t] / 2, penalised[:, t] * 2)
    assert tokens[4:] == penalised.argmax(-1).tolist()


def test_logprobs_are_batched_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 40, generator=g)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5), [], [], None),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=0, presence_penalty=2.0), [3], [], None),
        SamplingRow(SamplingParams(temperature=1.0), [], [], None),
    ]
    tokens, logprobs = sample(logits.clone(), rows, g)
    lp = torch.log_softmax(logits.double(), -1)
    first, second, third = logprobs
    assert math.isclose(first.logprob, float(lp[0, tokens[0]]), abs_tol=1e-5)
    assert [t for t, _ in first.top] == lp[0].topk(5).indices.tolist()
    assert all(math.isclose(v, float(lp[0, t]), abs_tol=1e-5) for t, v in first.top)
    assert math.isclose(second.logprob, float(lp[1, tokens[1]]), abs_tol=1e-5) and second.top == []
    assert third is None
