"""CUDA graphs for decode steps: capture the decode forward once per batch-size bucket, replay it.

A decode step of a small model on a fast GPU is bound by kernel launches (about ten per layer),
not by the GPU: a CUDA graph replays the whole step's launches at once. A graph fixes its
tensors' shapes and addresses, so:

- the decode forward is captured once at start-up for each bucket of `GraphBuckets` (1, 2, 4, 8,
  16, 24, ... up to max_num_seqs, as vLLM does), reading its inputs from static buffers sized for
  the largest bucket and writing the final hidden states into a static output buffer;
- a step of n decodes picks the smallest bucket b >= n, copies its inputs into rows [0, n) of
  the buffers and padding into rows [n, b), replays that bucket's graph and returns rows [0, n)
  of the output: the padding rows never reach the logits or the sampler;
- a padding row has token 0 at position 0, KV slot PAD_SLOT (-1, which every store_kv kernel
  skips, so it writes no KV) and a context of one token in block 0 (read, never written: its
  attention output is dropped). Padding rows are rewritten before every replay, so a row that
  held a real sequence in an earlier, larger step cannot write that sequence's KV slot again.

The graph object is injected (`new_graph`): `cuda_graph_factory()` gives torch.cuda.CUDAGraph
objects sharing one memory pool; CPU tests pass a stand-in that runs the captured function
eagerly, which exercises the buckets, buffers and padding without a GPU. The model runner
(workers/engine/model_runner.py) owns one DecodeGraphs on CUDA unless `--enforce-eager` is set; the CPU
path never uses one.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

PAD_SLOT = -1  # slot_mapping value the KV store kernels skip
MAX_CAPTURE_SIZE = 512  # larger decode batches run eagerly (launch overhead is amortised there)

# (input_ids [b], positions [b], slot_mapping [b], block_tables [b, W], context_lens [b]) -> hidden [b, H]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Graph(Protocol):
    """What DecodeGraphs needs of a graph: capture a function once, replay it."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


def graph_batch_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs,
    max_size), which is itself a size so that every batch up to it has a bucket."""
    if max_num_seqs < 1 or max_size < 1:
        raise ValueError(f"max_num_seqs and max_size must be >= 1, got {max_num_seqs}, {max_size}")
    limit = min(max_num_seqs, max_size)
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


class GraphBuckets:
    """Sorted batch sizes; a batch of n runs in the smallest one that holds it."""

    def __init__(self, sizes: Sequence[int]) -> None:
        sizes = sorted(set(sizes))
        if not sizes or sizes[0] < 1 or not all(isinstance(s, int) for s in sizes):
            raise ValueError(f"bucket sizes must be positive integers, got {sizes!r}")
        self.sizes: tuple[int, ...] = tuple(sizes)

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int | None:
        """The smallest size >= n, or None when n < 1 or no bucket holds n."""
        if n < 1 or n > self.largest:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)


class DecodeGraphs:
    """Static buffers, one captured graph per bucket, and the copy-in / replay / copy-out of a step.

    decode: the decode forward over a batch of b one-token sequences (see DecodeFn), run on
    slices [:b] of the static buffers; it must return the final hidden states [b, hidden_size].
    max_blocks_per_seq: the width of the static block table (the widest row a step may have).
    new_graph: makes one Graph per bucket (cuda_graph_factory() on CUDA).
    """

    def __init__(
        self,
        buckets: GraphBuckets,
        decode: DecodeFn,
        *,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        new_graph: Callable[[], Graph],
    ) -> None:
        if max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.buckets = buckets
        self.decode = decode
        self.new_graph = new_graph
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        n = buckets.largest
        # The static inputs, filled as padding (see reset_padding) until a step copies real rows in.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=self.device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=self.device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=self.device)
        self.output = torch.zeros((n, hidden_size), dtype=dtype, device=self.device)
        self.graphs: dict[int, Graph] = {}

    def capture(self) -> None:
        """Capture every bucket's graph, largest first (smaller captures reuse a shared pool's
        memory), on padding inputs: the capture writes no KV."""
        if self.graphs:
            raise RuntimeError("decode graphs are already captured")
        self.reset_padding(0)
        for size in reversed(self.buckets.sizes):
            graph = self.new_graph()
            graph.capture(self._step_fn(size))
            self.graphs[size] = graph

    def _step_fn(self, size: int) -> Callable[[], None]:
        def step() -> None:
            hidden = self.decode(
                self.input_ids[:size],
                self.positions[:size],
                self.slot_mapping[:size],
                self.block_tables[:size],
                self.context_lens[:size],
            )
            self.output[:size].copy_(hidden)

        return step

    def fits(self, block_rows: Sequence[Sequence[int]]) -> bool:
        """Whether a decode batch with these block tables can replay a graph."""
        return self.buckets.bucket_for(len(block_rows)) is not None and all(
            len(r) <= self.max_blocks_per_seq for r in block_rows
        )

    def reset_padding(self, start: int, end: int | None = None) -> None:
        """Rows [start, end) become padding: token 0, position 0, no KV slot, one token of context in block 0."""
        rows = slice(start, end)
        self.input_ids[rows] = 0
        self.positions[rows] = 0
        self.slot_mapping[rows] = PAD_SLOT
        self.block_tables[rows] = 0
        self.context_lens[rows] = 1

    def prepare(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        block_rows: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> int:
        """Copy one decode step's inputs into the static buffers (rows [0, n)), padding into rows
        [n, bucket); the bucket to replay.

        Each row's block table is copied up to the step's widest row; the columns after it keep
        earlier steps' values, which attention never reads (it stops at the context length).
        """
        n = len(block_rows)
        bucket = self.buckets.bucket_for(n)
        if bucket is None or not (len(input_ids) == len(positions) == len(slot_mapping) == len(context_lens) == n):
            raise ValueError(
                f"a decode batch of {n} sequences ({len(input_ids)} tokens) has no graph bucket "
                f"(largest {self.buckets.largest})"
            )
        width = max(1, max(len(r) for r in block_rows))
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks is wider than the graphs' {self.max_blocks_per_seq}")
        pad = bucket - n
        # One host tensor per buffer, one copy each, covering the padding rows too.
        host = torch.tensor(
            [
                list(input_ids) + [0] * pad,
                list(positions) + [0] * pad,
                list(slot_mapping) + [PAD_SLOT] * pad,
                list(context_lens) + [1] * pad,
            ],
            dtype=torch.int64,
        )
        table = torch.tensor(
            [list(r) + [0] * (width - len(r)) for r in block_rows] + [[0] * width] * pad, dtype=torch.int32
        )
        self.input_ids[:bucket].copy_(host[0], non_blocking=True)
        self.positions[:bucket].copy_(host[1], non_blocking=True)
        self.slot_mapping[:bucket].copy_(host[2], non_blocking=True)
        self.context_lens[:bucket].copy_(host[3], non_blocking=True)
        self.block_tables[:bucket, :width].copy_(table, non_blocking=True)
        return bucket

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        slot_mapping: Sequence[int],
        block_rows: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> torch.Tensor:
        """Run one decode step by replay: hidden states [n, hidden_size] of the n real rows only.
        The result is a view of the static output buffer, valid until the next replay."""
        if not self.graphs:
            raise RuntimeError("decode graphs are not captured yet")
        bucket = self.prepare(input_ids, positions, slot_mapping, block_rows, context_lens)
        self.graphs[bucket].replay()
        return self.output[: len(block_rows)]


class TorchCUDAGraph:
    """A torch.cuda.CUDAGraph behind the Graph protocol, capturing into `pool`."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], None]) -> None:
        # Warm up outside the graph, on a side stream: the first call compiles the Triton kernels
        # and sets up cuBLAS for these shapes, which must not happen during capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()
        torch.cuda.synchronize()

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    """A DecodeGraphs new_graph on CUDA: torch.cuda.CUDAGraph objects sharing one memory pool
    (their replays never overlap, and the outputs live in DecodeGraphs' own buffer)."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: TorchCUDAGraph(pool)


def decode_graphs_wanted(enforce_eager: bool, device: torch.device | str, kernel_backend: str) -> bool:
    """Whether decode steps replay CUDA graphs: on CUDA with the Triton kernels (the PyTorch
    references read tensor values on the host, which a capture forbids), unless enforce_eager."""
    return not enforce_eager and torch.device(device).type == "cuda" and kernel_backend == "triton"
