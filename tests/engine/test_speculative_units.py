"""Speculative decoding without a model: --speculative-config parsing, the n-gram proposer, the
per-position counters, and (chi-square, at the sampler level) that verifying a point-mass draft
keeps every emitted token's distribution.

The distribution oracle is tests/unit/test_sampling_distribution.py's, written in float64 from the
definitions of temperature, top-k, top-p, min-p and the penalties, independent of workers/engine/sampler.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from tests.unit.test_sampling_distribution import ALPHA, LOGITS, assert_same_distribution, chi_square_p_value, oracle
from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.sampler import SamplingRow, sample
from workers.engine.sequence import Sequence
from workers.speculative.ngram import ngram_drafts
from workers.speculative.speculator import SpecDecodeCounters, num_accepted
from workers.speculative.suffix_decoding import SuffixIndex, SuffixProposer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


# ---- configuration ------------------------------------------------------------------------
def test_vllm_keys_parse_into_the_engine_config():
    config = EngineConfig(speculative_config=NGRAM)
    assert config.speculative == SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert EngineConfig().speculative is None


@pytest.mark.parametrize(
    "text, named",
    [
        ('{"method": "ngram", ', "not valid JSON"),
        ('["ngram"]', "JSON object"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "speculative_config.model must name the draft"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "/m"}', "model is for method 'draft_model'"),
        (
            '{"method": "draft_model", "num_speculative_tokens": 4, "model": "/m", "quantization": "int4"}',
            "quantization must be null or 'fp8'",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 1.5}',
            "suffix_decoding_min_token_prob must be in [0, 1], got 1.5",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 0}',
            "suffix_decoding_max_spec_factor must be a number > 0",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": -1}',
            "suffix_decoding_max_tree_depth must be a positive integer",
        ),
        (
            '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": -2}',
            "suffix_decoding_max_cached_requests must be an integer >= 0",
        ),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "'eagle' is not yet supported"),
        ('{"method": "lookahead", "num_speculative_tokens": 4}', "speculative_config.method must be one of ngram"),
        ('{"method": "ngram"}', "needs the key 'num_speculative_tokens'"),
        ('{"num_speculative_tokens": 3}', "needs the key 'method'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens must be a positive integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_mix": 2}', "unknown key 'prompt_lookup_mix'"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_the_key(text, named):
    with pytest.raises(ValueError) as caught:
        EngineConfig(speculative_config=text)
    assert named in str(caught.value)


def test_baton_serve_has_the_flag_and_passes_it_to_the_workers():
    import argparse

    from cluster.config import BatonConfig, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--speculative-config", NGRAM])
    config = BatonConfig.load(None, vars(args))
    assert config.worker_engine_config().speculative.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="speculative_config.model must name the draft model's folder"):
        BatonConfig.load(None, {"speculative_config": '{"method": "draft_model", "num_speculative_tokens": 2}'})
    suffix = BatonConfig.load(None, {"speculative_config": '{"method": "suffix", "num_speculative_tokens": 6}'})
    assert suffix.worker_engine_config().speculative == SpeculativeConfig("suffix", 6)


# ---- the suffix proposer ------------------------------------------------------------------
def suffix_config(**keys) -> SpeculativeConfig:
    return SpeculativeConfig("suffix", keys.pop("num_speculative_tokens", 8), **keys)


def request(rid: str, prompt: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams())
    for token in output:
        seq.append_token(token)
    return seq


def test_the_suffix_index_counts_every_run_up_to_its_depth_and_forgets_them():
    index = SuffixIndex(depth=3)
    index.add([1, 2, 3, 1, 2, 4])
    root = index.root.children
    assert {t: n.count for t, n in root.items()} == {1: 2, 2: 2, 3: 1, 4: 1}
    assert {t: n.count for t, n in root[1].children[2].children.items()} == {3: 1, 4: 1}
    assert root[1].children[2].count == 2 and not root[1].children[2].children[3].children  # depth 3
    # Growing a sequence token by token counts the same runs as adding it whole.
    grown, runs = SuffixIndex(depth=3), []
    for token in [1, 2, 3, 1, 2, 4]:
        runs = grown.extend(runs, token)
    assert snapshot(grown.root) == snapshot(index.root)
    index.remove([1, 2, 3, 1, 2, 4])
    assert not index.root.children


def snapshot(node) -> dict:
    return {t: (c.count, snapshot(c)) for t, c in node.children.items()}


def test_suffix_drafts_follow_the_longest_match_for_as_long_as_it_earns():
    proposer = SuffixProposer(suffix_config())
    # "5 6" occurred before, followed by 7 8 5 6: a match of 2 earns 2 drafts (max_spec_factor 1.0).
    assert proposer.propose(request("a", [5, 6, 7, 8, 5, 6]), 8) == [7, 8]
    # "8 5 6" never occurred before, so "5 6" is the longest match; at max_spec_factor 2.0 it earns 4.
    doubled = SuffixProposer(suffix_config(suffix_decoding_max_spec_factor=2.0))
    assert doubled.propose(request("b", [5, 6, 7, 8, 5, 6]), 8) == [7, 8, 5, 6]
    assert doubled.propose(request("c", [1, 2, 3]), 8) == []  # nothing repeats


def test_suffix_drafts_stop_where_the_path_gets_unlikely():
    # After "1" came 2, 2 and 3: p(2 | 1) = 2/3.
    tokens = [1, 2, 9, 1, 2, 8, 1, 3, 7, 1]
    assert SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.5)).propose(request("a", tokens), 4) == [2]
    assert SuffixProposer(suffix_config(suffix_decoding_min_token_prob=0.7)).propose(request("a", tokens), 4) == []


def test_finished_outputs_feed_other_requests_and_the_oldest_leaves():
    proposer = SuffixProposer(suffix_config(suffix_decoding_max_cached_requests=1))
    first = request("a", [1], [7, 8, 9, 10])
    proposer.propose(first, 4)
    proposer.forget(first, finished=True)
    assert proposer.propose(request("b", [3, 7, 8]), 4) == [9, 10]  # from a's output
    aborted = request("c", [2], [20, 21, 22])
    proposer.forget(aborted, finished=False)  # an aborted request's output is not a hint
    assert proposer.propose(request("d", [20, 21]), 4) == []
    second = request("e", [2], [30, 31, 32])
    proposer.forget(second, finished=True)  # only one cached: a's output leaves
    assert proposer.propose(request("f", [7, 8]), 4) == [] and proposer.propose(request("g", [30, 31]), 4) == [32]


# ---- the n-gram proposer ------------------------------------------------------------------
def brute_force_ngram(tokens, min_n, max_n, k):
    """Written from the definition: for n from max_n down, the latest i < len - n with
    tokens[i:i+n] == the last n tokens; propose what follows it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_proposes_what_followed_the_longest_latest_match():
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 3, 9, 8, 2, 3, 5, 1, 2, 3]
    # Suffix (1, 2, 3) occurred at 1: drafts are what followed it.
    assert ngram_drafts(tokens, 2, 4, 3) == [9, 8, 2]
    # Only n = 2 allowed: (2, 3) latest earlier at 6 -> [5, 1].
    assert ngram_drafts(tokens, 2, 2, 2) == [5, 1]
    assert ngram_drafts([1, 2, 3, 4], 1, 3, 4) == []  # nothing repeats
    assert ngram_drafts(tokens, 2, 4, 0) == []
    # Near the end, fewer tokens follow the match than asked for.
    assert ngram_drafts([4, 4, 4], 1, 2, 5) == [4]


def test_ngram_agrees_with_the_definition_on_random_sequences():
    rng = torch.Generator().manual_seed(3)
    for _trial in range(300):
        length = int(torch.randint(1, 40, (1,), generator=rng))
        tokens = torch.randint(0, 4, (length,), generator=rng).tolist()
        lo = int(torch.randint(1, 4, (1,), generator=rng))
        hi = lo + int(torch.randint(0, 3, (1,), generator=rng))
        assert ngram_drafts(tokens, lo, hi, 3) == brute_force_ngram(tokens, lo, hi, 3), (tokens, lo, hi)


def test_acceptance_is_the_longest_agreeing_prefix():
    assert num_accepted([5, 6, 7], (5, 6)) == 2
    assert num_accepted([5, 9, 7], (5, 6)) == 1
    assert num_accepted([4, 6, 7], (5, 6)) == 0


def test_counters_count_per_position():
    counters = SpecDecodeCounters(4)
    counters.record(4, 2)
    counters.record(3, 3)
    counters.record(2, 0)
    stats = counters.snapshot()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.accepted_per_pos == (2, 2, 1, 0)


# ---- rejection sampling keeps the distribution (sampler level) --------------------------
N = 20_000
SECOND = list(reversed(LOGITS))  # the logits at the draft's own position: a different distribution

CASES = {
    "temperature 1": SamplingParams(),
    "temperature 0.6": SamplingParams(temperature=0.6),
    "top-k 3": SamplingParams(top_k=3),
    "top-p 0.7": SamplingParams(top_p=0.7),
    "min-p 0.2": SamplingParams(min_p=0.2),
    "top-k 6 + top-p 0.8 + min-p 0.1, T 1.3": SamplingParams(top_k=6, top_p=0.8, min_p=0.1, temperature=1.3),
    "penalties": SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3),
}


def verify_many(params: SamplingParams, draft: int, output: list[int], n: int = N):
    """n independent verifications of one draft after `output`, each as the engine runs it: the row
    at the last token's position and the row at the draft's position (the draft counted as output)
    in one batch, the emitted tokens those up to the first that disagrees with the draft."""
    rows, logits = [], []
    for _ in range(n):
        rows += [SamplingRow(params, list(output), [0, 1], None), SamplingRow(params, output + [draft], [0, 1], None)]
        logits += [LOGITS, SECOND]
    tokens, _ = sample(torch.tensor(logits, dtype=torch.float32), rows, torch.Generator().manual_seed(11))
    emitted = []
    for i in range(n):
        pair = tokens[2 * i : 2 * i + 2]
        emitted.append(pair[: num_accepted(pair, (draft,)) + 1])
    return emitted


# Draft 1 is likely everywhere; draft 5 is cut by top-k 3 (never accepted) and unlikely at temperature 1.
@pytest.mark.parametrize("name, draft", [(name, 1) for name in CASES] + [("top-k 3", 5), ("temperature 1", 5)])
@pytest.mark.slow  # a chi-square test per case over many draws: about 5 s in all here
def test_verifying_a_point_mass_draft_keeps_the_distribution(name, draft):
    params = CASES[name]
    output = [3, 3, 1]
    emitted = verify_many(params, draft, output)
    p0 = oracle(LOGITS, params, prompt=(0, 1), output=tuple(output))
    # The first emitted token follows p exactly as without a draft ...
    assert_same_distribution([e[0] for e in emitted], p0)
    # ... accepted with probability p(draft) (a two-sided binomial check, 6 sigma) ...
    accepted = [e for e in emitted if len(e) == 2]
    rate, sigma = len(accepted) / N, math.sqrt(max(p0[draft] * (1 - p0[draft]), 1e-12) / N)
    assert abs(rate - p0[draft]) < 6 * sigma + 1e-9, (rate, p0[draft])
    # ... on rejection from p with the draft removed and renormalised ...
    rejected = [e[0] for e in emitted if len(e) == 1]
    residual = [0.0 if t == draft else q / (1 - p0[draft]) for t, q in enumerate(p0)]
    assert_same_distribution(rejected, residual)
    # ... and after an accepted draft, the next token follows p at the draft's position.
    if p0[draft] > 0.05:
        p1 = oracle(SECOND, params, prompt=(0, 1), output=tuple(output + [draft]))
        assert_same_distribution([e[1] for e in accepted], p1)


def test_the_statistical_check_can_fail():
    """The acceptance check above rejects a verifier that accepts every draft."""
    p0 = oracle(LOGITS, SamplingParams(), output=())
    counts = [0] * len(LOGITS)
    counts[1] = N  # always the draft
    assert chi_square_p_value(counts, p0) < ALPHA


# ---- metrics ------------------------------------------------------------------------------
def test_the_workers_spec_decode_counters_are_exposed_with_vllms_names():
    """WorkerInfo.spec_decode (as the heartbeat's WorkerStats carries it) -> baton:spec_decode_*
    series, read back with prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from common.protocol import SpecDecodeStats
    from router.backend import WorkerInfo
    from router.metrics import RouterMetrics

    class Backend:
        prefix_index = None
        counters: dict = {}

        def workers(self):
            return [
                WorkerInfo("decode-0", "decode", spec_decode=SpecDecodeStats(5, 20, 9, (4, 3, 2, 0))),
                WorkerInfo("prefill-0", "prefill"),
            ]

    text = RouterMetrics("m", Backend()).render().decode()
    samples = {
        (s.name, s.labels["worker"], s.labels.get("position")): s.value
        for f in text_string_to_metric_families(text)
        if f.name.startswith("baton:spec_decode")
        for s in f.samples
    }
    assert samples[("baton:spec_decode_num_drafts_total", "decode-0", None)] == 5
    assert samples[("baton:spec_decode_num_draft_tokens_total", "decode-0", None)] == 20
    assert samples[("baton:spec_decode_num_accepted_tokens_total", "decode-0", None)] == 9
    assert [samples[("baton:spec_decode_num_accepted_tokens_per_pos_total", "decode-0", str(j))] for j in range(4)] == [
        4,
        3,
        2,
        0,
    ]
    assert samples[("baton:spec_decode_num_drafts_total", "prefill-0", None)] == 0
