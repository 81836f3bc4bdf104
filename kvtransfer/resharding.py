"""KV handoff between tensor-parallel groups of any two sizes: which rank pairs move which KV heads,
and one rank's side of it (`RankKV`).

A rank of a group of size N holds KV heads `kv_head_range(H, N, rank)` of the model's H (an even
split; past H ranks, each head on N // H ranks, as the sharded model keeps them). The two groups'
splits must nest (one size a multiple of the other, as the sharded model's own rules then make
them): each decode rank's heads are then either inside one prefill rank's heads, or exactly the
heads of several prefill ranks. `handoff_links` lists one link per (prefill rank, decode rank)
that moves heads: at most max(P, D) links, each one transfer of a whole run of blocks, whatever
the number of blocks or heads.

Transports move whole blocks of a registered cache and seal each block (kvtransfer.integrity), so
a link's bytes must be whole blocks of one layout on both ends. A link whose heads are part of
the sender's packs them first into a *staging* cache of the link's heads (sender side: prefill
TP smaller than decode TP); a link whose heads are part of the receiver's lands in an *inlet*
cache of the link's heads, copied into the rank's cache once every link of the request has
arrived intact (receiver side: prefill TP larger). Staging and inlet caches mirror the rank's
block ids (block i of the request's blocks is block i there too), so nothing allocates per
request; they cost as much memory as the rank's own cache at most, and only the rank that
needs them has them. The layout tag each block is sealed with covers the head range, so bytes
of one head range can never be accepted as another's.

A worker with a draft model (speculative decoding's draft_model) has a second cache on rank 0, the
draft's, with a transport of its own (`RankKV.allocate_draft`): every handoff then also moves the
same blocks of the draft's cache, rank 0 to rank 0 (the draft runs whole there), under the
request's transfer id + DRAFT_SUFFIX, and the receiver's blocks are ready only when both parts
arrived intact. The handshake covers the draft's layout, and a pair where only one side has a draft
is refused: its decode worker would otherwise run every prompt through the draft again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import torch

from common.protocol import KVEndpoint, KVLayout, KVLayoutMismatch
from common.tp_split import kv_head_range

from ._common import coalesce
from .base import KVTransport, TransferHandle, TransferResult, TransferSide, TransferStatus
from .integrity import FaultPlan

DRAFT_SUFFIX = "/draft"  # added to a request's transfer id for the draft model's part of its handoff


def head_range(layout: KVLayout) -> tuple[int, int]:
    """The model's KV heads a cache of `layout` holds (all of its heads when the layout names none)."""
    return layout.kv_heads or (0, layout.num_kv_heads)


def heads_layout(layout: KVLayout, heads: tuple[int, int]) -> KVLayout:
    """`layout` narrowed to the KV heads `heads` (model numbering), inside the layout's own."""
    lo, hi = head_range(layout)
    if not lo <= heads[0] < heads[1] <= hi:
        raise ValueError(f"KV heads {heads} are not inside the layout's {lo, hi}")
    return replace(layout, num_kv_heads=heads[1] - heads[0], kv_heads=heads)


@dataclass(frozen=True)
class HeadLink:
    """Prefill rank `src_rank` moves the model's KV heads `heads` of a request's blocks into decode
    rank `dst_rank`."""

    src_rank: int
    dst_rank: int
    heads: tuple[int, int]


def handoff_links(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadLink]:
    """Every link of a handoff from a group of src_tp ranks to one of dst_tp, by decode rank. Where a
    head is on several prefill ranks, the decode ranks take turns among them. Raises
    KVLayoutMismatch when the two splits do not nest."""
    sources = [kv_head_range(num_kv_heads, src_tp, r) for r in range(src_tp)]
    links: list[HeadLink] = []
    for dst in range(dst_tp):
        lo, hi = kv_head_range(num_kv_heads, dst_tp, dst)
        holders = [r for r, (a, b) in enumerate(sources) if a <= lo and hi <= b]
        if holders:
            links.append(HeadLink(holders[dst % len(holders)], dst, (lo, hi)))
            continue
        start = lo
        while start < hi:  # the decode rank's heads are whole prefill ranks' heads, one after another
            exact = [r for r, (a, b) in enumerate(sources) if a == start and b <= hi]
            if not exact:
                raise KVLayoutMismatch(
                    f"KV layout mismatch: tp_size prefill={src_tp} decode={dst_tp} split the model's {num_kv_heads} "
                    f"KV heads along different lines (decode rank {dst} holds heads {lo}..{hi - 1}); choose "
                    f"tensor-parallel sizes where one is a multiple of the other"
                )
            links.append(HeadLink(exact[0], dst, sources[exact[0]]))
            start = sources[exact[0]][1]
    return links


def link_id_suffix(link: HeadLink, links: Sequence[HeadLink]) -> str:
    """What a link's transfer id adds to the request's: nothing, unless its prefill rank sends the
    same heads to several decode ranks (replicated heads) through one transport, which then needs
    an id per decode rank."""
    shared = sum(1 for x in links if x.src_rank == link.src_rank and x.heads == link.heads) > 1
    return f"/{link.dst_rank}" if shared else ""


@dataclass(frozen=True)
class LinkResult:
    """How one link of a request's handoff ended (its bytes, for the trace's rank pairs)."""

    link: HeadLink
    result: TransferResult


def combined(results: Sequence[TransferResult]) -> TransferResult:
    """One request's transfer over several links: the worst status (TransferStatus sorts failures
    lowest), the bytes of all, the time of the slowest, the first failure's reason."""
    worst = min(results, key=lambda r: r.status)
    return replace(worst, nbytes=sum(r.nbytes for r in results), seconds=max(r.seconds for r in results))


def words(cache: torch.Tensor) -> torch.Tensor:
    """The cache's memory as the widest integers its rows of head_dim values divide into: copies
    move bytes (every dtype, FP8 included, bit-exact, without kernels for it), 8 at a time."""
    raw = cache.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[-1] % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def copy_heads(
    dst: torch.Tensor, dst_heads: slice, src: torch.Tensor, src_heads: slice, block_ids: Sequence[int]
) -> None:
    """dst[:, :, b, :, dst_heads] = src[:, :, b, :, src_heads] for every block b of block_ids: one
    strided copy per run of consecutive ids (a request's blocks mostly are one run)."""
    for start, _, count in coalesce(block_ids, block_ids):
        dst[:, :, start : start + count, :, dst_heads].copy_(src[:, :, start : start + count, :, src_heads])


# A rank's transports: every one of a RankKV is of the kind its new_transport makes (the worker's:
# kvtransfer.pairwise.PairwiseTransport).
TransportT = TypeVar("TransportT", bound=KVTransport)
_Transport_co = TypeVar("_Transport_co", bound=KVTransport, covariant=True)


@dataclass
class _HeadCache(Generic[_Transport_co]):
    """A cache of part of this rank's heads (a staging or an inlet cache) and its transport."""

    heads: tuple[int, int]
    transport: _Transport_co
    cache: torch.Tensor
    head_slice: slice  # where these heads sit in the rank's own cache

    @property
    def words(self) -> torch.Tensor:
        return words(self.cache)


@dataclass(frozen=True)
class _Route:
    link: HeadLink
    id_suffix: str  # link_id_suffix
    transport: KVTransport  # the rank's own, or a staging cache's
    peer_id: str
    staging: _HeadCache[KVTransport] | None


@dataclass
class _Receiving:
    block_ids: list[int]
    handles: list[tuple[KVTransport, TransferHandle, _HeadCache[KVTransport] | None]]


class RankKV(Generic[TransportT]):
    """One rank's side of every KV handoff: its own transport and cache, the staging caches its
    sends to finer decode groups need (made at the first connect to such a group), and the inlet
    caches its receives from a finer prefill group need (made here: the router passes the
    endpoint, inlets included, to every prefill worker). Thread-safe."""

    def __init__(
        self,
        transport: TransportT,
        cache: torch.Tensor,
        layout: KVLayout,
        rank: int,
        model_kv_heads: int,
        new_transport: Callable[[str], TransportT],
        peer_tp_size: int | None = None,
    ) -> None:
        """`new_transport(name)`: a transport of the same kind for a staging or inlet cache.
        `peer_tp_size`: the prefill group's size, when this rank receives (None: its own)."""
        self.transport, self.cache, self.layout, self.rank = transport, cache, layout, rank
        self._words = words(cache)
        self.model_kv_heads, self.tp_size = model_kv_heads, layout.tp_size
        self.heads = head_range(layout)
        if self.heads != kv_head_range(model_kv_heads, self.tp_size, rank):
            raise ValueError(
                f"rank {rank} of {self.tp_size} holds KV heads {self.heads}, not "
                f"{kv_head_range(model_kv_heads, self.tp_size, rank)}"
            )
        self._new_transport = new_transport
        self._fault_plan: FaultPlan | None = None
        self._lock = threading.Lock()
        self._staging: dict[tuple[int, int], _HeadCache[TransportT]] = {}
        self._routes: dict[tuple, list[_Route]] = {}
        self._receiving: dict[str, _Receiving] = {}
        src_tp = peer_tp_size or self.tp_size
        links = handoff_links(model_kv_heads, src_tp, self.tp_size)
        # What this rank receives: through its own transport, or an inlet, and under which id (link_id_suffix).
        self._inbound: list[tuple[_HeadCache[TransportT] | None, str]] = [
            (None if link.heads == self.heads else self._head_cache(link.heads, "inlet"), link_id_suffix(link, links))
            for link in links
            if link.dst_rank == rank
        ]
        self._inlets = [inlet for inlet, _ in self._inbound if inlet is not None]
        self.draft: TransportT | None = None  # the draft model's cache's transport (allocate_draft)

    def allocate_draft(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        """The draft model's KV cache, allocated through a transport of its own (in shared memory
        where the pair's backend wants it), so that handoffs carry the draft's KV too. Rank 0 only."""
        if self.rank != 0 or self.draft is not None:
            raise ValueError(f"a draft model's cache belongs to rank 0, once (this is rank {self.rank})")
        transport = self._new_transport("draft")
        if self._fault_plan is not None:
            transport.set_fault_plan(self._fault_plan)
        cache = transport.allocate_cache(layout, num_blocks)
        self.draft = transport
        return cache

    def _head_cache(self, heads: tuple[int, int], kind: str) -> _HeadCache[TransportT]:
        transport = self._new_transport(f"{kind}{heads[0]}-{heads[1]}")
        if self._fault_plan is not None:
            transport.set_fault_plan(self._fault_plan)
        cache = transport.allocate_cache(heads_layout(self.layout, heads), int(self.cache.shape[2]))
        return _HeadCache(heads, transport, cache, slice(heads[0] - self.heads[0], heads[1] - self.heads[0]))

    def endpoint(self) -> KVEndpoint:
        """The rank's endpoint, with those of its inlets (a prefill rank sends a part of this rank's
        heads to the inlet of exactly those heads)."""
        return replace(
            self.transport.endpoint(),
            inlets=tuple(i.transport.endpoint() for i in self._inlets),
            draft=self.draft.endpoint() if self.draft is not None else None,
        )

    def transports(self) -> list[TransportT]:
        with self._lock:
            return [
                self.transport,
                *(c.transport for c in self._staging.values()),
                *(i.transport for i in self._inlets),
                *([self.draft] if self.draft is not None else []),
            ]

    # ---- sender ---------------------------------------------------------------------------
    def connect(self, peers: Sequence[KVEndpoint]) -> list[HeadLink]:
        """Handshake with every decode rank this rank sends to (`peers`: the decode worker's ranks
        in order); raises KVLayoutMismatch naming the field. Returns this rank's links."""
        return [route.link for route in self._routes_to(peers)]

    def _routes_to(self, peers: Sequence[KVEndpoint]) -> list[_Route]:
        key = tuple(p.peer_key for p in peers)
        routes = self._routes.get(key)
        if routes is not None:
            return routes
        routes = []
        links = handoff_links(self.model_kv_heads, self.tp_size, len(peers))
        for link in links:
            if link.src_rank != self.rank:
                continue
            target = peers[link.dst_rank]
            if head_range(target.layout) != link.heads:
                inlet = [e for e in target.inlets if head_range(e.layout) == link.heads]
                if not inlet:
                    raise KVLayoutMismatch(
                        f"KV layout mismatch: kv_heads: decode rank {link.dst_rank} holds {head_range(target.layout)} "
                        f"and offers no inlet for heads {link.heads} (its prefill tensor-parallel size is not this "
                        f"group's {self.tp_size})"
                    )
                target = inlet[0]
            staging = None
            if link.heads != self.heads:
                with self._lock:
                    staging = self._staging.get(link.heads)
                    if staging is None:
                        staging = self._staging[link.heads] = self._head_cache(link.heads, "staging")
            transport = staging.transport if staging else self.transport
            routes.append(_Route(link, link_id_suffix(link, links), transport, transport.connect(target), staging))
        if self.rank == 0:
            routes += self._draft_route(peers[0])
        self._routes[key] = routes
        return routes

    def _draft_route(self, peer: KVEndpoint) -> list[_Route]:
        """The route of the draft model's KV to a decode worker's rank 0 (none without a draft);
        KVLayoutMismatch when only one side has a draft or their drafts' layouts differ."""
        if (self.draft is None) != (peer.draft is None):
            which = (
                "this prefill worker runs a draft model and"
                if self.draft is not None
                else "this prefill worker runs no draft model but"
            )
            raise KVLayoutMismatch(
                f"KV layout mismatch: speculative_config: {which} the decode worker it connects to "
                f"{'does not' if peer.draft is None else 'does'} (the draft's KV travels with every handoff); give "
                f"both pools the same --speculative-config"
            )
        if self.draft is None or peer.draft is None:  # both, after the check above
            return []
        try:
            peer_id = self.draft.connect(peer.draft)
        except KVLayoutMismatch as exc:
            raise KVLayoutMismatch(f"the draft model's cache (speculative_config.model): {exc}") from None
        link = HeadLink(0, 0, head_range(peer.draft.layout))
        return [_Route(link, DRAFT_SUFFIX, self.draft, peer_id, None)]

    def send(
        self,
        peers: Sequence[KVEndpoint],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float,
    ) -> list[tuple[_Route, TransferHandle]]:
        """Start this rank's links of one request's handoff; `wait_sent` ends them."""
        routes = self._routes_to(peers)
        staged: set[tuple[int, int]] = set()
        sends = []
        for route in routes:
            staging = route.staging
            if staging is not None and staging.heads not in staged:
                copy_heads(staging.words, slice(None), self._words, staging.head_slice, src_block_ids)
                staged.add(staging.heads)
            sends.append(
                (
                    route,
                    route.transport.send(
                        route.peer_id, src_block_ids, dst_block_ids, transfer_id + route.id_suffix, timeout_s
                    ),
                )
            )
        return sends

    @staticmethod
    def wait_sent(sends: list[tuple[_Route, TransferHandle]]) -> list[LinkResult]:
        return [LinkResult(route.link, route.transport.wait(handle)) for route, handle in sends]

    # ---- receiver -------------------------------------------------------------------------
    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        """Announce a request's blocks to every transport that receives a part of them."""
        handles: list[tuple[KVTransport, TransferHandle, _HeadCache[KVTransport] | None]] = []
        try:
            for inlet, id_suffix in self._inbound:
                transport = self.transport if inlet is None else inlet.transport
                handles.append((transport, transport.expect(transfer_id + id_suffix, dst_block_ids, timeout_s), inlet))
            if self.draft is not None:
                handles.append(
                    (self.draft, self.draft.expect(transfer_id + DRAFT_SUFFIX, dst_block_ids, timeout_s), None)
                )
        except BaseException:  # the parts announced already must not land in blocks the caller frees
            for announced, handle, _ in handles:
                announced.abort(handle.transfer_id)
            raise
        with self._lock:
            self._receiving[transfer_id] = _Receiving(list(dst_block_ids), handles)

    def wait_received(self, transfer_id: str) -> TransferResult:
        """Wait for every part expect() announced; once all arrived intact, the inlets' heads are
        copied into the rank's cache, and the request's blocks are ready."""
        with self._lock:
            receiving = self._receiving.pop(transfer_id, None)
        if receiving is None:
            return TransferResult(
                transfer_id,
                TransferSide.RECV,
                TransferStatus.FAILED,
                0,
                0.0,
                f"rank {self.rank} expected no KV for {transfer_id}",
            )
        result = combined([transport.wait(handle) for transport, handle, _ in receiving.handles])
        if result.ok:  # a failed handoff's good parts stay in the inlets: nothing of it reaches the cache
            for inlet in (inlet for _, _, inlet in receiving.handles if inlet is not None):
                copy_heads(self._words, inlet.head_slice, inlet.words, slice(None), receiving.block_ids)
        return result

    def abort(self, transfer_id: str) -> None:
        """End a request's transfers into this rank; once this returns no more bytes land."""
        with self._lock:
            receiving = self._receiving.pop(transfer_id, None)
        for transport, handle, _ in receiving.handles if receiving else []:
            transport.abort(handle.transfer_id)

    def set_fault_plan(self, plan: FaultPlan | None) -> None:
        """Faults for this rank's sends, on every link, staging caches made later included (tests)."""
        self._fault_plan = plan
        for transport in self.transports():
            transport.set_fault_plan(plan)

    def close(self) -> None:
        for transport in self.transports():
            transport.close()
