"""KV handoff between tensor-parallel groups of different sizes (kvtransfer.resharding).

Oracles: the links of each pair of sizes, written out by hand; and for the bytes, one random cache
of the whole model, of which every prefill rank holds its heads: after a handoff each decode rank
must hold exactly the whole cache's bytes of its heads in the reserved blocks, and nothing else
may change. Over every CPU backend, float32 and FP8, with a checksum fault on one link."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from common.protocol import KVLayout, KVLayoutMismatch
from common.tp_split import kv_head_range
from kvtransfer import Fault, FaultKind, FaultPlan
from kvtransfer.resharding import HeadLink, handoff_links
from testkit.kvtransfer import handoff as run_handoff
from testkit.kvtransfer import rank_group

H3, H4, H2 = 3, 4, 2


def links(num_kv_heads: int, src_tp: int, dst_tp: int) -> set[tuple[int, int, tuple[int, int]]]:
    return {(x.src_rank, x.dst_rank, x.heads) for x in handoff_links(num_kv_heads, src_tp, dst_tp)}


def test_links_of_each_pair_of_sizes():
    # SmolLM2's 3 KV heads: TP 3 -> 1 gathers three heads into one rank; 1 -> 3 slices them apart.
    assert links(H3, 3, 1) == {(0, 0, (0, 1)), (1, 0, (1, 2)), (2, 0, (2, 3))}
    assert links(H3, 1, 3) == {(0, 0, (0, 1)), (0, 1, (1, 2)), (0, 2, (2, 3))}
    assert links(H3, 3, 3) == {(r, r, (r, r + 1)) for r in range(3)}
    assert links(H4, 2, 4) == {(0, 0, (0, 1)), (0, 1, (1, 2)), (1, 2, (2, 3)), (1, 3, (3, 4))}
    assert links(H4, 4, 2) == {(0, 0, (0, 1)), (1, 0, (1, 2)), (2, 1, (2, 3)), (3, 1, (3, 4))}
    assert links(H4, 2, 1) == {(0, 0, (0, 2)), (1, 0, (2, 4))}
    assert links(H4, 1, 2) == {(0, 0, (0, 2)), (0, 1, (2, 4))}
    # Past the KV heads they are replicated (TP 4 on 2 heads: ranks 0, 1 hold head 0): each head is
    # taken once, and decode ranks holding the same head take turns among the prefill ranks with it.
    assert links(H2, 4, 1) == {(0, 0, (0, 1)), (2, 0, (1, 2))}
    assert links(H2, 1, 4) == {(0, r, (r // 2, r // 2 + 1)) for r in range(4)}
    assert links(H2, 4, 4) == {(r, r, (r // 2, r // 2 + 1)) for r in range(4)}
    assert links(H2, 2, 4) == {(0, 0, (0, 1)), (0, 1, (0, 1)), (1, 2, (1, 2)), (1, 3, (1, 2))}


def test_splits_that_do_not_nest_are_refused():
    with pytest.raises(KVLayoutMismatch, match=r"tp_size prefill=2 decode=3 split the model's 6 KV heads"):
        handoff_links(6, 2, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 KV heads"):
        kv_head_range(6, 4, 0)


def whole_cache(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """Random bytes of the whole model's cache, `[L, 2, N, block_size, H, head_dim * itemsize]`."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layout.block_bytes * num_blocks,), generator=g, dtype=torch.uint8)
    return raw.view(*layout.cache_shape(num_blocks)[:-1], -1)


class Group:
    """The ranks of one worker (testkit.kvtransfer.rank_group), all in this process."""

    def __init__(self, kind: str, model: KVLayout, tp: int, num_blocks: int, peer_tp: int | None) -> None:
        self.ranks = rank_group(kind, model, tp, num_blocks, peer_tp)

    def endpoints(self):
        return [r.endpoint() for r in self.ranks]

    def close(self) -> None:
        for r in self.ranks:
            r.close()


@contextlib.contextmanager
def groups(kind, model, src_tp, dst_tp, num_blocks):
    prefill = Group(kind, model, src_tp, num_blocks, None)
    try:
        decode = Group(kind, model, dst_tp, num_blocks, src_tp)
        try:
            yield prefill, decode
        finally:
            decode.close()
    finally:
        prefill.close()


def handoff(prefill: Group, decode: Group, src_ids, dst_ids, transfer_id: str):
    return run_handoff(prefill.ranks, decode.ranks, src_ids, dst_ids, transfer_id, timeout_s=10.0)


CASES = [(H3, 3, 1), (H3, 1, 3), (H4, 2, 4), (H4, 4, 2), (H2, 4, 1), (H2, 1, 4), (H3, 3, 3)]


# Every pair on the in-process and shared-memory backends in both dtypes; gloo (slower to connect)
# on SmolLM2's pairs in float32: every backend moves bytes the same way.
PAIRS = [
    (kind, *case, dtype) for kind in ("inprocess", "shm") for case in CASES for dtype in ("float32", "float8_e4m3fn")
] + [("gloo", H3, 3, 1, "float32"), ("gloo", H3, 1, 3, "float32")]


@pytest.mark.parametrize("kind, num_kv_heads, src_tp, dst_tp, dtype", PAIRS)
def test_each_decode_rank_gets_exactly_its_heads(kind, num_kv_heads, src_tp, dst_tp, dtype):
    scales = ((0.5, 0.25), (1.5, 2.0)) if dtype != "float32" else ()
    model = KVLayout(num_layers=2, num_kv_heads=num_kv_heads, head_dim=8, block_size=4, dtype=dtype, kv_scales=scales)
    num_blocks = 12
    whole = whole_cache(model, num_blocks, seed=7)
    src_ids, dst_ids = [5, 0, 6, 7, 2], [1, 9, 10, 3, 4]
    with groups(kind, model, src_tp, dst_tp, num_blocks) as (prefill, decode):
        for rank in prefill.ranks:
            lo, hi = rank.heads
            rank.cache.view(torch.uint8).copy_(whole[:, :, :, :, lo:hi])
        sent, received = handoff(prefill, decode, src_ids, dst_ids, "req-1")
        assert all(r.result.ok for r in sent) and all(r.ok for r in received), (sent, received)
        # One transfer per link, each of the link's heads of all five blocks.
        head_bytes = model.block_bytes // num_kv_heads
        assert sorted((r.link.src_rank, r.link.dst_rank, r.result.nbytes) for r in sent) == sorted(
            (x.src_rank, x.dst_rank, 5 * head_bytes * (x.heads[1] - x.heads[0]))
            for x in handoff_links(num_kv_heads, src_tp, dst_tp)
        )
        for rank in decode.ranks:
            lo, hi = rank.heads
            got = rank.cache.view(torch.uint8)
            expected = torch.zeros_like(got)
            expected[:, :, dst_ids] = whole[:, :, src_ids, :, lo:hi]
            assert torch.equal(got, expected), f"decode rank {rank.rank} (heads {lo}..{hi - 1})"


@pytest.mark.parametrize("kind", ["inprocess", "shm"])
@pytest.mark.parametrize("src_tp, dst_tp", [(3, 1), (1, 3)])
def test_a_corrupted_link_fails_the_handoff(kind, src_tp, dst_tp):
    model = KVLayout(num_layers=2, num_kv_heads=H3, head_dim=8, block_size=4, dtype="float32")
    with groups(kind, model, src_tp, dst_tp, 8) as (prefill, decode):
        for rank in prefill.ranks:
            rank.cache.normal_()
        # A bit flipped in transit on the link into the last decode rank from the last prefill rank.
        prefill.ranks[-1].set_fault_plan(FaultPlan({"bad": Fault(FaultKind.FLIP, block=1, bit=3)}))
        _, received = handoff(prefill, decode, [1, 2, 3], [4, 5, 6], "bad")
        assert not received[-1].ok and received[-1].reason == "checksum"
        if dst_tp == 1:  # the good parts stay in the inlets: nothing of a failed handoff reaches the cache
            assert not decode.ranks[0].cache.any()
        _, clean = handoff(prefill, decode, [1, 2, 3], [4, 5, 6], "good")
        assert all(r.ok for r in clean)
        for rank in decode.ranks:
            lo, hi = rank.heads
            assert torch.equal(
                rank.cache[:, :, [4, 5, 6]],
                torch.cat([p.cache[:, :, [1, 2, 3]] for p in prefill.ranks], dim=4)[..., lo:hi, :],
            )


def test_a_decode_rank_without_the_inlet_a_link_needs_is_refused():
    model = KVLayout(num_layers=1, num_kv_heads=H3, head_dim=8, block_size=4, dtype="float32")
    # The decode worker was started for a TP-1 prefill pool: it offers no inlet for single heads.
    prefill, decode = Group("inprocess", model, 3, 4, None), Group("inprocess", model, 1, 4, 1)
    try:
        for rank in prefill.ranks:
            with pytest.raises(
                KVLayoutMismatch,
                match=rf"decode rank 0 holds \(0, 3\) and offers no inlet for "
                rf"heads \({rank.rank}, {rank.rank + 1}\)",
            ):
                rank.connect(decode.endpoints())
        # Started for this prefill pool, it pairs: one link from each prefill rank.
        fitting = Group("inprocess", model, 1, 4, 3)
        try:
            assert [rank.connect(fitting.endpoints()) for rank in prefill.ranks] == [
                [HeadLink(r, 0, (r, r + 1))] for r in range(3)
            ]
        finally:
            fitting.close()
    finally:
        prefill.close()
        decode.close()


DRAFT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4, dtype="bfloat16")  # a draft model's


@pytest.mark.parametrize("kind", ["inprocess", "shm"])
@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (3, 1), (1, 3)])
def test_a_draft_models_cache_travels_in_the_same_handoff(kind, src_tp, dst_tp):
    """Rank 0 of each side has a draft cache (another layout, its own blocks' count): the handoff
    moves the same blocks of it, rank 0 to rank 0; a fault in the draft's part fails the handoff."""
    model = KVLayout(num_layers=2, num_kv_heads=H3, head_dim=8, block_size=4, dtype="float32")
    with groups(kind, model, src_tp, dst_tp, 8) as (prefill, decode):
        sent_draft = prefill.ranks[0].allocate_draft(DRAFT, 10)
        got_draft = decode.ranks[0].allocate_draft(DRAFT, 10)
        for rank in prefill.ranks:
            rank.cache.normal_()
        sent_draft.normal_()
        sent, received = handoff(prefill, decode, [1, 2, 3], [4, 5, 6], "req")
        assert all(r.ok for r in received)
        assert (0, 0, 3 * DRAFT.block_bytes) in {(r.link.src_rank, r.link.dst_rank, r.result.nbytes) for r in sent}
        assert torch.equal(got_draft[:, :, [4, 5, 6]], sent_draft[:, :, [1, 2, 3]])
        assert not got_draft[:, :, [0, 1, 2, 3, 7, 8, 9]].any()  # nothing else changed
        # A bit flipped in the draft's part only: the request's blocks are not ready.
        prefill.ranks[0].set_fault_plan(FaultPlan({"bad/draft": Fault(FaultKind.FLIP, block=0, bit=5)}))
        _, received = handoff(prefill, decode, [1, 2, 3], [4, 5, 6], "bad")
        assert not received[0].ok and received[0].reason == "checksum"


def test_a_pair_where_one_side_has_no_draft_or_another_draft_is_refused():
    model = KVLayout(num_layers=1, num_kv_heads=H3, head_dim=8, block_size=4, dtype="float32")
    with groups("inprocess", model, 1, 1, 4) as (prefill, decode):
        decode.ranks[0].allocate_draft(DRAFT, 4)
        with pytest.raises(
            KVLayoutMismatch,
            match="speculative_config: this prefill worker runs no draft model but "
            "the decode worker it connects to does",
        ):
            prefill.ranks[0].connect(decode.endpoints())
        prefill.ranks[0].allocate_draft(dataclasses.replace(DRAFT, num_layers=2), 4)
        with pytest.raises(
            KVLayoutMismatch,
            match=r"draft model's cache \(speculative_config.model\): KV layout "
            r"mismatch: num_layers local=2 peer=1",
        ):
            prefill.ranks[0].connect(decode.endpoints())
    with groups("inprocess", model, 1, 1, 4) as (prefill, decode):
        prefill.ranks[0].allocate_draft(DRAFT, 4)
        with pytest.raises(KVLayoutMismatch, match="runs a draft model and the decode worker it connects to does not"):
            prefill.ranks[0].connect(decode.endpoints())
