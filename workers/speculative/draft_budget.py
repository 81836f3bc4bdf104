"""When drafts pay: how many drafts each decoding sequence verifies in a step.

A draft costs one more token in the step and is worth its chance of being accepted. Drafts are
accepted in order until the first rejection, so with a sequence's measured acceptance per position
alpha, its j-th draft counts with probability alpha^j. The step's cost is measured on the engine's own
steps as t = a + b * tokens. A step of T tokens expected to emit E tokens gives E / (a + b T) tokens
per second, and one more draft with chance g raises that exactly when

    g > rho * E / (1 + rho * T),        rho = b / a (a token's cost against the step's fixed cost).

Taking drafts in falling order of chance while that holds maximises the expected tokens per second:
each draft taken raises E / (1 + rho T), so the bound only rises and the first draft that misses it
ends the plan. Drafts therefore thin out as the batch grows (a decode-only batch of n sequences
starts at the bound rho n / (1 + rho n)), as acceptance falls, and as tokens get dearer (rho is fitted
per batch size, StepCostFit: on this CPU a draft costs 0.15-0.18 of a step at batches of 1 and 4,
bench/speculative_step_cost.py; a GPU's decode step costs nearly the same for 1 token as for 64,
so drafts pay there at any batch).

Proposing costs too, and not as verifying does: a draft model runs a pass over the batch per draft
position, whatever the verified tokens. So the proposer's time is measured apart from the step's
(StepCostFit.observe_proposal; the step's fit gets the step less it) as delta, the seconds of a
proposed draft against the step's fixed cost a, per batch size (before any is measured, the
proposer's relative_cost over n: a draft model's bytes against the target's, what a memory-bound pass
costs, shared by the n sequences it drafts for; or, where more, what a pass cost at fewer sequences,
over n: a pass over more sequences costs no less). A batch size without a measured step proposes
nothing until one step measured its fixed part.
Whether to propose a first draft then compares its chance with the bound of a draft that costs both:

    (rho + delta) * n / (1 + rho * n)                (entry_bound, a step of n decodes)

Once proposed, the drafts' proposal is spent, and which of them to verify (draft_counts) weighs rho
alone. Without the split, a draft model's passes go into the step's fixed cost (they do not grow with
the verified tokens), and at 16 sequences on a CPU a bfloat16 self-draft whose drafts were nearly all
accepted was proposed at every step, at about half the throughput of no drafts.

A sequence that verified no draft for PROBE_STEPS decode steps is given one, so that an estimate
that went low can recover when the text turns repetitive (one token every PROBE_STEPS steps), while
the worker's pooled acceptance would pay for a first draft in the step (above it, as in a large batch
at a CPU's rho, no sequence drafts and none probes: the step costs what it costs without drafts), or,
until the worker has verified POOL_PRIOR_WEIGHT drafts, whatever the bound but for one sequence every
PROBE_STEPS steps of the worker: a costly proposer (a draft model) would otherwise never be tried at
the prior acceptance, and its probe may first have to run the sequence's tokens through the draft.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.5  # before any draft was verified on this worker
# The worker's pooled acceptance counts as this many trials in a sequence's estimate: light, so that a
# sequence whose drafts keep failing falls below any bound (at most 1 / (1 - SEQUENCE_DECAY) = 10
# rejections are remembered; the estimate then reaches prior / 21).
PRIOR_WEIGHT = 0.5
# The worker's pooled acceptance starts as this many trials at PRIOR_ACCEPTANCE: heavy enough that a
# reply's first few misses (its opening words are rarely in the prompt) do not decide for the whole
# worker. With a light prior two rejections took the pool below a batch of one's bound at rho 0.15;
# then no sequence drafted or probed again, so the estimate could never recover.
POOL_PRIOR_WEIGHT = 8.0
SEQUENCE_DECAY = 0.9  # per verification: copying comes in runs, so a sequence's recent drafts count most
POOL_DECAY = 0.99  # per verification, for the worker's pooled acceptance
COST_DECAY = 0.99  # per observed step: the fit follows the host's load
# rho for a batch size until its steps with and without drafts were measured: what a verified draft
# cost in decode steps of 1 and 4 sequences on this CPU (0.15-0.18, bench/results/speculative_step_cost_b*.json),
# so that a worker drafts only where drafts are likely to pay until it has measured its own steps.
PRIOR_TOKEN_COST = 0.15
MAX_TOKEN_COST = 1.0  # a token costing as much as the step's fixed part: drafts pay only when nearly sure
MIN_COST_WEIGHT = 20.0  # decayed steps observed before the fit is used
MIN_TOKEN_VARIANCE = 0.25  # steps must differ in size for a slope (a batch without drafts never does)
PROBE_STEPS = 16
# The prior delta counts as this many proposed drafts in the measured one, so that the first few
# (a pass that happened to wait for a core) do not decide alone.
DRAFT_COST_PRIOR_WEIGHT = 4.0


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and of rejections (verifications that rejected a draft).
    accepted / (accepted + rejections) is the maximum-likelihood chance per position for drafts
    accepted in order until the first rejection."""

    decay: float
    accepted: float = 0.0
    rejections: float = 0.0

    def record(self, num_drafts: int, accepted: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.rejections = self.rejections * self.decay + (1.0 if accepted < num_drafts else 0.0)

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejections + prior_weight)


@dataclass
class DraftHistory:
    """One request's drafts: its totals (reported with its outputs), its recent acceptance and the
    decode steps since it last verified drafts (state of the request, kept across preemption)."""

    drafted: int = 0
    accepted: int = 0
    recent: Acceptance = field(default_factory=lambda: Acceptance(SEQUENCE_DECAY))
    idle_steps: int = 0

    def record(self, num_drafts: int, accepted: int) -> None:
        if not num_drafts:
            return
        self.drafted += num_drafts
        self.accepted += accepted
        self.recent.record(num_drafts, accepted)
        self.idle_steps = 0

    def skip_step(self) -> None:
        """This decode step verifies none of its drafts."""
        self.idle_steps += 1

    @property
    def due_a_probe(self) -> bool:
        return self.idle_steps >= PROBE_STEPS


class StepCostFit:
    """Least squares of a step's seconds on its tokens, t = a + b * tokens, over decayed sums of the
    engine's all-decode steps, one fit per number of decoding sequences; token_cost(n) is rho = b / a
    for a step of n sequences.

    One fit per batch size because a CPU's step is not one line: across batch sizes an extra
    sequence costs ~0.05 of the fixed part (bench/results/cost_profile_cpu.json), but within a
    batch of 1 or 4 each verified draft costs 0.15-0.18 (bench/results/speculative_step_cost_b*.json).
    A fit over every step mixes the two, and steps without drafts (most of them) pull it to the
    cheap slope, so drafts were verified that cost more than they gave. Within one batch size only
    drafts make steps differ in size, which is exactly the cost in question."""

    def __init__(self, decay: float = COST_DECAY, prior: float = PRIOR_TOKEN_COST, draft_prior: float = 0.0) -> None:
        """`prior`: rho until measured; `draft_prior` / n: delta until measured (see the module docstring)."""
        self.decay = decay
        self.prior = min(prior, MAX_TOKEN_COST)
        self.draft_prior = draft_prior
        self._sums: dict[int, list[float]] = {}  # per batch size: weight, x, y, x*x, x*y
        self._last_fit: dict[int, float] = {}
        self._proposals: dict[int, list[float]] = {}  # per batch size: decayed seconds, drafts proposed

    def observe_proposal(self, num_decoding: int, drafts: int, seconds: float) -> None:
        """The proposer took `seconds` to propose `drafts` drafts for a step of num_decoding sequences."""
        if drafts < 1 or not seconds >= 0:
            return
        sums = self._proposals.setdefault(num_decoding, [0.0, 0.0])
        sums[:] = [sums[0] * self.decay + seconds, sums[1] * self.decay + drafts]

    def draft_cost(self, num_decoding: int) -> float:
        """delta for a step of num_decoding sequences: a proposed draft's seconds against the step's
        fixed seconds a (from its mean step at the fitted or prior rho), shrunk toward the prior."""
        sums = self._sums.get(num_decoding)
        if sums is None or sums[0] < 1.0:
            # Before any step, the bytes' prior. Once steps are measured, a batch size without one
            # yet drafts nothing until a step measured its fixed part: another size's says little
            # (on a CPU it halves from 1 to 16 sequences), and a wrong one can make a first round of
            # drafts catch up on 16 prompts at once.
            return self.draft_prior / max(num_decoding, 1) if not self._sums else MAX_TOKEN_COST
        w, sx, sy = sums[:3]
        fixed = sy / w / (1 + self.token_cost(num_decoding) * sx / w)
        if not fixed > 0:
            return MAX_TOKEN_COST
        # A pass drafts for the batch and costs at least what one over fewer sequences did: the
        # seconds of a draft measured at m < n sequences, times m, over n (else the bytes' prior).
        floor = max(
            (s / d * m / num_decoding for m, (s, d) in self._proposals.items() if m < num_decoding and d > 0),
            default=0.0,
        )
        prior = max(self.draft_prior / max(num_decoding, 1), floor / fixed)
        seconds, drafts = self._proposals.get(num_decoding, (0.0, 0.0))
        return (seconds / fixed + prior * DRAFT_COST_PRIOR_WEIGHT) / (drafts + DRAFT_COST_PRIOR_WEIGHT)

    def observe(self, num_decoding: int, tokens: int, seconds: float) -> None:
        if num_decoding < 1 or tokens < num_decoding or not seconds > 0:
            return
        x, y = float(tokens), float(seconds)
        sums = self._sums.setdefault(num_decoding, [0.0] * 5)
        sums[:] = [s * self.decay + v for s, v in zip(sums, (1.0, x, y, x * x, x * y))]

    def token_cost(self, num_decoding: int) -> float:
        """rho for a step of num_decoding sequences, clamped to [0, MAX_TOKEN_COST]; that batch
        size's last fit (at first the prior) while its recent steps are too few or too alike in
        size to fit a slope."""
        last = self._last_fit.get(num_decoding, self.prior)
        sums = self._sums.get(num_decoding)
        if sums is None or sums[0] < MIN_COST_WEIGHT:
            return last
        w, sx, sy, sxx, sxy = sums
        mean_x, mean_y = sx / w, sy / w
        variance = sxx / w - mean_x * mean_x
        if variance < MIN_TOKEN_VARIANCE:
            return last
        slope = (sxy / w - mean_x * mean_y) / variance
        intercept = mean_y - slope * mean_x
        rho = MAX_TOKEN_COST if intercept <= 0 else slope / intercept
        self._last_fit[num_decoding] = min(max(rho, 0.0), MAX_TOKEN_COST)
        return self._last_fit[num_decoding]


def entry_bound(num_decoding: int, token_cost: float, draft_cost: float = 0.0) -> float:
    """The chance a first draft must beat in a step of num_decoding sequences without drafts, for
    proposing it (draft_cost: delta) or, once proposed, for verifying it (draft_cost 0)."""
    return (token_cost + draft_cost) * num_decoding / (1 + token_cost * num_decoding)


def most_that_could_pay(acceptance: float, bound: float, limit: int, probe: bool) -> int:
    """At most how many drafts a sequence can get in a step whose first draft must beat bound
    (entry_bound): its j-th draft's chance acceptance ** j must beat it too (the bound only rises);
    a probe gets one regardless. Capped by limit."""
    most = 0
    while most < limit and acceptance ** (most + 1) > bound:
        most += 1
    return max(most, 1 if probe and limit > 0 else 0)


def draft_counts(
    available: list[int], acceptance: list[float], token_cost: float, probes: list[bool], budget: int
) -> list[int]:
    """How many of its available drafts each decoding sequence verifies this step (see the module's
    docstring): probes take one draft first, then drafts in falling order of chance while each
    raises the expected tokens per second, at most budget drafts in all."""
    assert len(available) == len(acceptance) == len(probes)
    counts = [1 if probe and n > 0 else 0 for probe, n in zip(probes, available)]
    over = sum(counts) - max(budget, 0)
    for i in range(len(counts) - 1, -1, -1):  # more probes than budget: the latest sequences wait
        if over > 0 and counts[i]:
            counts[i], over = 0, over - 1
    expected = len(available) + sum(a for a, c in zip(acceptance, counts) if c)
    tokens = len(available) + sum(counts)
    heap = [
        (-(acceptance[i] ** (counts[i] + 1)), i)
        for i in range(len(available))
        if counts[i] < available[i] and acceptance[i] > 0
    ]
    heapq.heapify(heap)
    while heap and tokens - len(available) < budget:
        gain = -heap[0][0]
        if gain * (1 + token_cost * tokens) <= token_cost * expected:
            break
        i = heapq.heappop(heap)[1]
        counts[i] += 1
        expected += gain
        tokens += 1
        if counts[i] < available[i]:
            heapq.heappush(heap, (-(acceptance[i] ** (counts[i] + 1)), i))
    return counts
