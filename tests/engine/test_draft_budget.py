"""How many drafts pay (workers.speculative.draft_budget): the plan against a brute-force search over every
choice of draft counts, hand-computed cases, the step-cost fit against the line it was drawn from,
the acceptance estimate, and a sequence whose drafts stop paying."""

from __future__ import annotations

import itertools
import random

import pytest

from common.sampling_params import SamplingParams
from workers.config import SpeculativeConfig
from workers.engine.sequence import Sequence
from workers.speculative.draft_budget import (
    MAX_TOKEN_COST,
    PRIOR_TOKEN_COST,
    PROBE_STEPS,
    Acceptance,
    DraftHistory,
    StepCostFit,
    draft_counts,
    entry_bound,
)
from workers.speculative.speculator import Speculator


def tokens_per_cost(counts: list[int], acceptance: list[float], token_cost: float) -> float:
    """Expected tokens emitted over the step's relative cost, from the definition: sequence i emits
    its own token plus draft j with probability acceptance_i ** j (accepted in order)."""
    expected = sum(1 + sum(a**j for j in range(1, k + 1)) for k, a in zip(counts, acceptance))
    return expected / (1 + token_cost * (len(counts) + sum(counts)))


def best_by_search(available, acceptance, token_cost, probes, budget) -> float:
    best = 0.0
    for counts in itertools.product(*[range(n + 1) for n in available]):
        if sum(counts) > budget or any(p and n and k < 1 for p, n, k in zip(probes, available, counts)):
            continue
        best = max(best, tokens_per_cost(list(counts), acceptance, token_cost))
    return best


def test_the_plan_is_as_good_as_any_choice_of_counts():
    rng = random.Random(5)
    for _ in range(400):
        n = rng.randint(1, 4)
        available = [rng.randint(0, 4) for _ in range(n)]
        acceptance = [rng.choice([0.0, 0.05, 0.2, 0.5, 0.8, 0.95, rng.random()]) for _ in range(n)]
        token_cost = rng.choice([0.0, 0.01, 0.05, 0.2, 1.0])
        probes = [rng.random() < 0.2 for _ in range(n)]
        budget = rng.randint(0, 12)
        counts = draft_counts(available, acceptance, token_cost, probes, budget)
        assert all(0 <= k <= a for k, a in zip(counts, available)) and sum(counts) <= budget
        if sum(1 for p, a in zip(probes, available) if p and a) <= budget:
            assert tokens_per_cost(counts, acceptance, token_cost) == pytest.approx(
                best_by_search(available, acceptance, token_cost, probes, budget), rel=1e-12
            ), (available, acceptance, token_cost, probes, budget, counts)


def test_hand_computed_plans():
    # One sequence, acceptance 0.5, a token at 5% of the step: tokens per cost for 0..4 drafts are
    # 1/1.05, 1.5/1.1, 1.75/1.15, 1.875/1.2, 1.9375/1.25 = 0.952, 1.364, 1.522, 1.5625, 1.55.
    assert draft_counts([4], [0.5], 0.05, [False], 8) == [3]
    # Acceptance 0.18 (what sampling at temperature 1 gets on the repetition workload): one draft
    # pays alone (0.18 * 1.05 > 0.05) and beside 3 others (the first: 0.18 * 1.2 > 0.2), none in a
    # batch of 16 (0.18 * 1.8 < 0.8).
    assert draft_counts([4], [0.18], 0.05, [False], 8) == [1]
    assert draft_counts([4] * 4, [0.18] * 4, 0.05, [False] * 4, 16) == [1] * 4
    assert draft_counts([4] * 16, [0.18] * 16, 0.05, [False] * 16, 64) == [0] * 16
    assert entry_bound(16, 0.05) == pytest.approx(0.8 / 1.8)
    # Free tokens (a GPU's small batch): every available draft with any chance.
    assert draft_counts([4, 2, 3], [0.1, 0.0, 0.9], 0.0, [False] * 3, 16) == [4, 0, 3]
    # A probe drafts one even when it does not pay; the budget caps everything.
    assert draft_counts([4, 4], [0.01, 0.9], 0.05, [True, False], 2) == [1, 1]
    assert draft_counts([4, 4], [0.01, 0.01], 0.05, [True, True], 1) == [1, 0]


def test_the_step_cost_fit_finds_each_batch_sizes_line():
    rng = random.Random(2)
    fit = StepCostFit()
    assert fit.token_cost(4) == PRIOR_TOKEN_COST  # nothing measured
    # Batches of 4 whose drafts cost 0.2 of the fixed part, and batches of 16 sequences whose drafts
    # cost 0.05 of theirs, interleaved as a worker's batch size changes: each size gets its own line.
    for _ in range(200):
        drafts = rng.randint(0, 12)
        fit.observe(4, 4 + drafts, (0.020 + 0.004 * (4 + drafts)) * rng.uniform(0.97, 1.03))
        drafts = rng.randint(0, 12)
        fit.observe(16, 16 + drafts, (0.040 + 0.002 * (16 + drafts)) * rng.uniform(0.97, 1.03))
    assert fit.token_cost(4) == pytest.approx(0.2, rel=0.1)
    assert fit.token_cost(16) == pytest.approx(0.05, rel=0.1)
    assert fit.token_cost(8) == PRIOR_TOKEN_COST  # a batch size never seen
    # Then batches of 4 without drafts only (steps of one size): no slope to fit, the last fit stays.
    for _ in range(2000):
        fit.observe(4, 4, 0.5)
    assert fit.token_cost(4) == pytest.approx(0.2, rel=0.1)
    # Steps of one size across batch sizes are not a slope either: a fit that pooled the sizes
    # (1 sequence 21 ms, 16 sequences 52 ms) would give rho 0.1 here.
    pooled = StepCostFit()
    for _ in range(100):
        pooled.observe(1, 1, 0.021)
        pooled.observe(16, 16, 0.052)
    assert pooled.token_cost(1) == pooled.token_cost(16) == PRIOR_TOKEN_COST


def test_a_proposed_drafts_cost_is_its_seconds_over_the_steps_fixed_part():
    fit = StepCostFit(decay=1.0, draft_prior=0.2)
    assert fit.draft_cost(1) == 0.2 and fit.draft_cost(16) == 0.2 / 16  # one pass drafts for the batch
    # Verification steps of 1 sequence: t = 20 ms + 1 ms per token (rho 0.05, fixed part a = 20 ms).
    for tokens in [1, 5] * 15:
        fit.observe(1, tokens, 0.020 + 0.001 * tokens)
    assert fit.token_cost(1) == pytest.approx(0.05)
    # A batch size without a step yet proposes nothing until one measured its fixed part.
    assert fit.draft_cost(16) == MAX_TOKEN_COST and entry_bound(16, PRIOR_TOKEN_COST, MAX_TOKEN_COST) > 1
    # 100 proposed drafts took 1 s: 10 ms each, delta 0.5, shrunk toward the prior by its 4 drafts' weight.
    fit.observe_proposal(1, 100, 1.0)
    assert fit.draft_cost(1) == pytest.approx((0.5 * 100 + 0.2 * 4) / 104)
    # At 4 sequences, before a draft is measured there: a pass costs no less than the 10 ms one at 1
    # sequence, so a draft no less than 10 / 4 ms, against that batch's fixed part of 40 ms (more than
    # the bytes' prior 0.2 / 4).
    for tokens in [4, 8] * 15:
        fit.observe(4, tokens, 0.040 + 0.001 * tokens)
    assert fit.draft_cost(4) == pytest.approx(0.0025 / 0.040)
    # A first draft must then beat (rho + delta) n / (1 + rho n) to be proposed.
    assert entry_bound(1, 0.05, 0.5) == pytest.approx(0.55 / 1.05)
    assert entry_bound(16, 0.05, 0.0) == pytest.approx(0.8 / 1.8)


class DraftingProposer:
    """A proposer that always has drafts; what they cost is fed to the fit by hand."""

    relative_cost = 0.0

    def __init__(self) -> None:
        self.asked = 0

    def propose_many(self, seqs, limits, generators=None):
        self.asked += len(seqs)
        return [[7] * limit for limit in limits]

    def forget(self, seq, finished):
        pass

    def drafting_seconds(self, measured):
        return None  # the test feeds the fit


def test_drafts_that_are_nearly_all_accepted_are_not_proposed_where_their_passes_cost_more():
    """A draft model on a CPU: at 16 sequences a step's fixed part is small against its tokens, and a
    draft pass costs about a decode of the batch, so even drafts accepted 95% of the time cost more
    than they give; at 1 sequence, the same drafts pay."""
    speculator = Speculator(SpeculativeConfig("ngram", 4), 4096, DraftingProposer())
    for _ in range(10):
        speculator.pooled.record(4, 4)  # the worker's drafts were all accepted
    for tokens in [16, 48] * 15:  # 16 sequences: t = 8 ms + 1.5 ms per token (rho 0.19)
        speculator.step_cost.observe(16, tokens, 0.008 + 0.0015 * tokens)
    speculator.step_cost.observe_proposal(16, 160, 0.25)  # a pass of 16 drafts: 25 ms (delta 0.2)
    for tokens in [1, 5] * 15:  # 1 sequence: t = 20 ms + 0.5 ms per token (rho 0.025)
        speculator.step_cost.observe(1, tokens, 0.020 + 0.0005 * tokens)
    speculator.step_cost.observe_proposal(1, 40, 0.48)  # a pass of 1 draft: 12 ms (delta 0.6)
    history = DraftHistory()
    for _ in range(10):
        history.record(4, 4)
    seqs = [sequence([1, 2, 3] * 5) for _ in range(16)]
    assert speculator.drafts(seqs, 256, lambda s: history) == [[]] * 16
    assert speculator.proposer.asked == 0
    assert speculator.drafts(seqs[:1], 256, lambda s: history) == [[7] * 4]


def test_acceptance_is_accepted_over_accepted_plus_rejections():
    acceptance = Acceptance(decay=1.0)
    acceptance.record(4, 4)  # all accepted: no rejection
    acceptance.record(4, 1)
    acceptance.record(2, 0)
    assert acceptance.rate(prior=0.5, prior_weight=0.0) == pytest.approx(5 / 7)
    assert acceptance.rate(prior=0.5, prior_weight=1.0) == pytest.approx(5.5 / 8)
    decayed = Acceptance(decay=0.5)
    decayed.record(4, 4)
    decayed.record(4, 0)
    assert (decayed.accepted, decayed.rejections) == (2.0, 1.0)


def sequence(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=64, temperature=0.0))


def test_a_sequence_whose_drafts_fail_stops_drafting_then_probes():
    speculator = Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=2), 4096)
    seq = sequence([1, 2, 3] * 10)  # the n-gram proposer always has 4 drafts for it
    history = DraftHistory()
    drafted = []
    for _ in range(80):
        drafts = speculator.drafts([seq], 64, lambda s: history)[0]
        drafted.append(len(drafts))
        if drafts:
            history.record(len(drafts), 0)  # every draft rejected (the worker's pooled rate stays at its prior)
    # At the prior rho 0.15 the prior acceptance 0.5 pays for 2 drafts: 0.5 * 1.15 > 0.15 * 1, then
    # 0.25 * 1.3 > 0.15 * 1.5, but 0.125 * 1.45 < 0.15 * 1.75. The misses pull the estimate down.
    assert PRIOR_TOKEN_COST == 0.15
    assert drafted[0] == 2 and drafted[1:10] == sorted(drafted[1:10], reverse=True)
    quiet = drafted[20:]
    probes = [i for i, n in enumerate(quiet) if n]
    assert len(probes) >= 3 and all(quiet[i] == 1 for i in probes)  # only probes, one draft each
    assert all(b - a == PROBE_STEPS + 1 for a, b in zip(probes, probes[1:]))
    # Accepted drafts bring it back.
    for _ in range(4):
        while not (drafts := speculator.drafts([seq], 64, lambda s: history)[0]):
            pass
        history.record(len(drafts), len(drafts))
    assert len(speculator.drafts([seq], 64, lambda s: history)[0]) >= 2


def test_no_proposal_is_made_for_a_sequence_whose_first_draft_cannot_pay():
    asked = []

    class CountingProposer:
        def propose(self, seq, max_drafts):
            asked.append(seq)
            return [7] * max_drafts

        def forget(self, seq, finished):
            pass

    speculator = Speculator(SpeculativeConfig("ngram", 4, disable_by_batch_size=None), 4096)
    speculator.proposer = CountingProposer()
    low = DraftHistory()
    for _ in range(6):
        low.record(4, 0)
    seqs = [sequence([1, 2, 3]) for _ in range(16)]
    out = speculator.drafts(seqs, 256, lambda s: low)
    assert out == [[]] * 16 and not asked
    assert low.idle_steps == 16  # one skipped step per sequence sharing it


class ConstantTokenCost:
    """A CPU-like rho, fixed so the engine test below does not depend on how fast this host runs."""

    def __init__(self, rho: float) -> None:
        self.rho = rho

    def token_cost(self, num_decoding: int) -> float:
        return self.rho

    def observe(self, num_decoding: int, tokens: int, seconds: float) -> None:
        pass

    def draft_cost(self, num_decoding: int) -> float:
        return 0.0

    def observe_proposal(self, num_decoding: int, drafts: int, seconds: float) -> None:
        pass


def test_the_engine_drafts_while_drafts_are_accepted_and_stops_when_they_are_not():
    from tests.engine.helpers import save_tiny_model
    from tests.engine.test_draft_model import draft_config
    from tests.engine.test_speculative_engine import engine, passage_prompts, run

    target, _ = save_tiny_model("llama")
    other, _ = save_tiny_model(
        "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    )
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def drafts_per_step(draft: str, prompts: list[list[int]]) -> tuple[float, float]:
        eng = engine(target, draft_config(draft), adaptive=True)
        eng.speculator.step_cost = ConstantTokenCost(0.05)
        run(eng, prompts, greedy)
        stats = eng.stats().spec_decode
        decode_steps = len(prompts) * greedy.max_tokens - stats.num_accepted_tokens
        return stats.num_draft_tokens / decode_steps, stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)

    # The model drafting for itself: every draft accepted, so all 4 are verified nearly every step.
    per_step, rate = drafts_per_step(target, passage_prompts(1))
    assert rate == 1.0 and per_step > 3
    # A draft that is never right, 16 at once: after the first misses, almost nothing is drafted.
    per_step, rate = drafts_per_step(other, passage_prompts(16, seed=9))
    assert rate < 0.1 and per_step < 0.1


def test_the_proposer_is_asked_only_for_drafts_that_could_pay():
    from workers.speculative.draft_budget import most_that_could_pay

    # bound 0.2: 0.5 ** 2 = 0.25 beats it, 0.5 ** 3 does not.
    assert most_that_could_pay(0.5, 0.2, 4, probe=False) == 2
    assert most_that_could_pay(0.5, 0.2, 1, probe=False) == 1
    assert most_that_could_pay(0.1, 0.2, 4, probe=False) == 0
    assert most_that_could_pay(0.1, 0.2, 4, probe=True) == 1
    assert most_that_could_pay(0.9, 0.0, 4, probe=False) == 4
    assert most_that_could_pay(0.9, 0.0, 0, probe=True) == 0
