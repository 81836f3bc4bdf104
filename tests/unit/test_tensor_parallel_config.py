"""Tensor parallelism's plain parts: the flags and their checks, what a worker's ranks ask Ray for,
the layout handshake's TP fields, a step's inputs as rank 0 broadcasts them, and how the ranks'
transfer results add up. Hand-computed expectations throughout."""

from __future__ import annotations

import argparse
import hashlib

import pytest

from cluster.config import BatonConfig, PlacementConfig, add_flags
from cluster.placement import PoolPlacement, rank_bundles
from common.protocol import KVLayout, KVLayoutMismatch


def parse(*argv: str) -> BatonConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return BatonConfig.load(None, vars(parser.parse_args(list(argv))))


def test_tp_flags_short_and_long_and_each_pool_falls_back_to_the_common_size():
    config = parse("-tp", "3").placement
    assert (config.tensor_parallel_size, config.tp_size("prefill"), config.tp_size("decode")) == (3, 3, 3)
    config = parse(
        "--tensor-parallel-size", "2", "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "2"
    ).placement
    assert (config.tp_size("prefill"), config.tp_size("decode")) == (2, 2)
    assert PlacementConfig().tp_size("decode") == 1


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
        (dict(decode_tensor_parallel_size=-2), "decode_tensor_parallel_size must be a positive integer, got -2"),
        (
            dict(prefill_tensor_parallel_size=2, decode_tensor_parallel_size=3),
            "prefill_tensor_parallel_size 2 and decode_tensor_parallel_size 3: one must be a multiple of the other",
        ),
        (
            dict(tensor_parallel_size=4, decode_tensor_parallel_size=6),
            "prefill_tensor_parallel_size 4 and decode_tensor_parallel_size 6: one must be a multiple",
        ),
    ],
)
def test_bad_tp_sizes_are_refused_naming_the_flag(options, message):
    with pytest.raises(ValueError, match=message):
        PlacementConfig(**options)


@pytest.mark.parametrize("prefill, decode", [(3, 1), (1, 3), (2, 4), (4, 2)])
def test_pools_of_nesting_sizes_are_accepted(prefill, decode):
    config = PlacementConfig(prefill_tensor_parallel_size=prefill, decode_tensor_parallel_size=decode)
    assert (config.tp_size("prefill"), config.tp_size("decode")) == (prefill, decode)


def test_without_a_prefill_pool_the_decode_size_stands_alone():
    assert PlacementConfig(prefill_workers=0, decode_tensor_parallel_size=4).tp_size("decode") == 4


def test_the_cores_are_split_between_every_rank(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert BatonConfig.from_options(tensor_parallel_size=3).worker_threads() == 2  # 2 workers x 3 ranks
    assert BatonConfig.from_options(decode_workers=2).worker_threads() == 4  # 3 workers x 1 rank
    assert BatonConfig.from_options(tensor_parallel_size=3, threads_per_worker=5).worker_threads() == 5


def test_a_workers_ranks_bundles():
    gpu = PoolPlacement("decode", num_cpus=4, num_gpus=1, resources={"baton_decode": 1})
    # The pool's resource once per worker (a node type offers one per worker); CPUs and GPUs per rank.
    assert rank_bundles(gpu, 3) == [{"CPU": 4, "GPU": 1, "baton_decode": 1}, {"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}]
    cpu = PoolPlacement("prefill", num_cpus=0, num_gpus=0)
    assert rank_bundles(cpu, 2) == [{"CPU": 0.01}, {"CPU": 0.01}]  # Ray refuses an empty bundle


def layout(**overrides) -> KVLayout:
    fields = dict(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32")
    return KVLayout(**{**fields, **overrides})


def test_the_handshake_pairs_equal_heads_and_refuses_other_heads():
    with pytest.raises(KVLayoutMismatch, match=r"kv_heads local=None peer=\(1, 2\)"):
        layout(tp_size=3, kv_heads=(0, 1)).check_compatible(layout(tp_size=3, kv_heads=(1, 2)))
    layout(tp_size=3, kv_heads=(2, 3)).check_compatible(layout(tp_size=3, kv_heads=(2, 3)))
    # The same heads in groups of other sizes are the same bytes: a TP-4 rank holding head 1 of 2 pairs
    # with a TP-2 rank holding it, and heads 0..n-1 of n with a cache that names none.
    layout(tp_size=4, kv_heads=(1, 2)).check_compatible(layout(tp_size=2, kv_heads=(1, 2)))
    assert layout(tp_size=3, kv_heads=(0, 1)) == layout(tp_size=3)
    with pytest.raises(ValueError, match="kv_heads .* must be a range of num_kv_heads"):
        layout(kv_heads=(0, 2))


def test_the_block_checksum_tag_covers_a_ranks_heads_and_is_unchanged_without_tp():
    from kvtransfer.integrity import layout_tag

    plain = layout()
    # The tag's definition before tensor parallelism, computed here by hand: TP 1 stays wire-compatible.
    text = repr((2, 1, 64, 16, "float32", ()))
    assert layout_tag(plain) == int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (
        (1 << 63) - 1
    )
    tags = [layout_tag(layout(tp_size=3, kv_heads=(h, h + 1))) for h in range(3)]
    assert len(set(tags)) == 3 and tags[0] == layout_tag(plain)  # head 0 of a one-head cache is the plain layout


def test_step_inputs_of_a_mixed_batch():
    from common.sampling_params import SamplingParams
    from workers.engine.sequence import ScheduledChunk, Sequence
    from workers.engine.step_inputs import StepInputs

    decoding = Sequence("d", [1, 2, 3, 4, 5], SamplingParams())
    decoding.block_ids, decoding.num_computed_tokens = [7, 2], 4  # its 5th token runs now
    prefilling = Sequence("p", [9, 8, 7, 6], SamplingParams())
    prefilling.block_ids, prefilling.num_computed_tokens = [3], 1  # a chunk of its last 3
    step = StepInputs.of([ScheduledChunk(decoding, 1), ScheduledChunk(prefilling, 3)], [True, True], block_size=4)
    assert step.input_ids == [5, 8, 7, 6] and step.positions == [4, 1, 2, 3]
    assert step.slots == [2 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3]
    assert (step.num_decode, step.decode_rows, step.decode_lens) == (1, [[7, 2]], [5])
    assert (step.prefill_rows, step.prefill_lens, step.query_start) == ([[3]], [4], [0, 3])
    assert step.logits_index == [0, 3]
    assert step.prompt_runs == [(0, 4)]  # both sequences' tokens are still prompt tokens


def test_step_inputs_mark_prompt_rows_and_leave_generated_tokens_and_drafts_out():
    from common.sampling_params import SamplingParams
    from workers.engine.sequence import ScheduledChunk, Sequence
    from workers.engine.step_inputs import StepInputs

    decoding = Sequence("d", [1, 2, 3], SamplingParams())
    decoding.output_token_ids = [4]
    decoding.token_ids, decoding.block_ids, decoding.num_computed_tokens = [1, 2, 3, 4], [5], 3
    drafting = Sequence("s", [1, 2], SamplingParams())
    drafting.output_token_ids = [3]
    drafting.token_ids, drafting.block_ids, drafting.num_computed_tokens = [1, 2, 3], [6, 10], 2
    recomputed = Sequence("r", [7, 8, 9], SamplingParams())  # preempted after two outputs: all five again
    recomputed.output_token_ids = [10, 11]
    recomputed.token_ids, recomputed.block_ids = [7, 8, 9, 10, 11], [7, 8]
    prompt = Sequence("p", [12, 13], SamplingParams())
    prompt.block_ids = [9]
    chunks = [
        ScheduledChunk(decoding, 1),
        ScheduledChunk(drafting, 3, draft_token_ids=(4, 5)),
        ScheduledChunk(recomputed, 5),
        ScheduledChunk(prompt, 2),
    ]
    step = StepInputs.of(chunks, [True] * 4, block_size=4)
    # Rows: 0 decode; 1-3 the drafting sequence's last token and drafts; 4-8 the recomputed sequence
    # (its 3 prompt tokens, then 2 outputs); 9-10 the new prompt.
    assert step.prompt_runs == [(4, 7), (9, 11)]


def test_the_ranks_transfer_results_add_up_to_the_worst_status():
    from kvtransfer import TransferResult, TransferStatus
    from kvtransfer.base import TransferSide
    from kvtransfer.resharding import combined

    ok = TransferResult("r", TransferSide.RECV, TransferStatus.SUCCESS, 100, 0.5)
    bad = TransferResult(
        "r", TransferSide.RECV, TransferStatus.FAILED, 40, 0.25, "checksum", reason="checksum_mismatch"
    )
    assert combined([ok, ok]) == TransferResult("r", TransferSide.RECV, TransferStatus.SUCCESS, 200, 0.5)
    worst = combined([ok, bad, ok])
    assert (worst.status, worst.nbytes, worst.seconds, worst.reason) == (
        TransferStatus.FAILED,
        240,
        0.5,
        "checksum_mismatch",
    )
