"""A tensor-parallel group: this process's rank, the all-reduce its model calls, and the step
broadcast from rank 0 to the other ranks (the package docstring, workers.parallel, says how the
ranks share a worker)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# How long a non-zero rank waits for rank 0's next step: an idle worker sends none for as long as
# no request comes, so the wait has no useful bound. A dead rank 0 ends it at once all the same
# (its sockets close), and the group is torn down with it.
STEP_WAIT = timedelta(days=3650)


class TPGroupBroken(RuntimeError):
    """A rank of the group is gone: the group cannot step again and is restarted whole."""


class TPGroup:
    """This process's place in a tensor-parallel group: the all-reduce the model calls, and the
    step broadcast from rank 0 (over a gloo group, also on GPUs: the inputs are Python lists).

    Size 1 (`TPGroup.single()`) needs no torch.distributed: all_reduce returns its input. A larger
    group is one torch.distributed process group per process (gloo on the CPU, NCCL on CUDA),
    made by `TPGroup.connect`; `close` tears it down.
    """

    def __init__(self, rank: int, size: int, backend: str | None = None, control=None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"TP rank {rank} is outside a group of size {size}")
        self.rank = rank
        self.size = size
        self.backend = backend
        self._control = control  # the gloo group steps are broadcast on

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def connect(cls, rank: int, size: int, init_method: str, device: str = "cpu", timeout_s: float = 120.0) -> TPGroup:
        """Join the group every rank names with the same init_method (e.g. tcp://127.0.0.1:PORT)."""
        if size == 1:
            return cls.single()
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        control = dist.new_group(backend="gloo", timeout=STEP_WAIT)  # every rank makes it, in the same order
        return cls(rank, size, backend, control)

    def broadcast_step(self, step) -> None:
        """Rank 0: send one step's inputs (or None: the end) to every other rank."""
        assert self.rank == 0 and self.size > 1
        try:
            dist.broadcast_object_list([step], src=0, group=self._control)
        except RuntimeError as exc:
            raise TPGroupBroken(f"a rank of this tensor-parallel group of {self.size} is gone: {exc}") from exc

    def receive_step(self):
        """A non-zero rank: the next step's inputs from rank 0 (None: the end)."""
        assert self.rank > 0
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self._control)
        except RuntimeError as exc:
            raise TPGroupBroken(f"rank 0 of this tensor-parallel group is gone: {exc}") from exc
        return box[0]

    def all_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the ranks agree on a KV cache's block count)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._control)
        return int(tensor.item())

    def all_max(self, values: list[float]) -> list[float]:
        """The elementwise largest of every rank's `values` (float64 on the control group)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        return tensor.tolist()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of every rank's `tensor`, in place; returns it."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        dist.all_reduce(tensor)
        return tensor

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
