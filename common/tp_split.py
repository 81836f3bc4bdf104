"""How a tensor-parallel group splits a model, torch-free: the rules the engine shards by
(workers.parallel), the KV handoff re-slices by (kvtransfer.resharding) and the simulator
sizes by (cluster.sim.costs), so a size one of them accepts the others accept too.
"""

from __future__ import annotations


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The model's KV heads [start, stop) that rank `rank` of a group of `tp_size` holds: an even
    split, or past the KV heads each head on tp_size // num_kv_heads ranks (replicated, as vLLM does)."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"need tensor_parallel_size >= 1 and 0 <= rank < it, got size {tp_size}, rank {rank}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {num_kv_heads} KV heads")
        per_rank = num_kv_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} exceeds the model's {num_kv_heads} KV heads and is not a "
            f"multiple of it (each KV head must be replicated on the same number of ranks)"
        )
    head = rank * num_kv_heads // tp_size
    return head, head + 1


def check_tp_split(
    tp_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    num_experts: int = 0,
    moe_intermediate_size: int = 0,
    expert_parallel: bool = False,
    dense_mlps: bool = True,
) -> None:
    """Raise ValueError naming what a group of tp_size cannot split evenly: the query heads, the KV
    heads, a dense MLP's intermediate channels (`dense_mlps`: the model has dense MLP layers), and an
    MoE's experts (whole, with expert_parallel) or their intermediate channels."""
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {num_heads} query heads")
    if dense_mlps and intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's intermediate_size {intermediate_size}"
        )
    if num_experts and expert_parallel and num_experts % tp_size:
        raise ValueError(
            f"--enable-expert-parallel: tensor_parallel_size {tp_size} does not divide the model's "
            f"{num_experts} experts"
        )
    if num_experts and not expert_parallel and moe_intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the experts' intermediate size "
            f"{moe_intermediate_size} (--enable-expert-parallel splits whole experts)"
        )
    kv_head_range(num_kv_heads, tp_size, 0)  # its own checks of the KV heads
