"""One rank's share of a worker: the model (its shard at tensor-parallel size > 1), the KV cache
allocated through the rank's own KV transport, and the layout both are described by. Rank 0
(`workers.shell.worker`) and the other ranks (`workers.parallel.rank`) build theirs alike, at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.protocol import KVLayout
from common.roles import Role
from common.tp_split import kv_head_range
from kvtransfer import PairwiseTransport, Place, dtype_name
from kvtransfer.resharding import RankKV, handoff_links
from workers.config import EngineConfig, WorkerConfig
from workers.engine.kv_cache import kv_cache_num_blocks, kv_cache_torch_dtype
from workers.engine.loader import kv_cache_scales
from workers.lora.adapter import LoRASharding
from workers.models.config import ModelConfig
from workers.models.files import ModelNotFoundError, resolve_model_dir
from workers.models.llama import LlamaForCausalLM
from workers.parallel.group import TPGroup
from workers.parallel.sharding import load_sharded_model


@dataclass
class RankShard:
    """What one rank of a worker holds: its view of the model (its heads at TP > 1), the weights,
    and its KV cache allocated through its own transport."""

    model_dir: Path  # the resolved model folder
    model_config: ModelConfig
    engine_config: EngineConfig  # kv_scales filled in for an FP8 cache
    model: LlamaForCausalLM  # the loaded torch module
    # Its KV transports: its own cache's, and those of the parts of its heads it re-slices.
    kv: RankKV[PairwiseTransport]
    kv_cache: torch.Tensor
    lora_sharding: LoRASharding | None = None  # its cut of LoRA adapters (ShardPlan.lora_sharding)


def build_rank_shard(config: WorkerConfig, group: TPGroup) -> RankShard:
    """Load this rank's shard of the model and allocate its KV cache through the transport (which
    may put it in shared memory). Every rank of a group calls it at once: loading and sizing the
    cache run collectives (FP8 KV calibration's forward passes, the block count all ranks share)."""
    ec = config.engine
    try:
        model_dir = resolve_model_dir(config.model, quiet=True)
    except ModelNotFoundError as exc:  # every node needs the files: say which one lacks them
        raise ModelNotFoundError(f"worker {config.worker_id} on node {config.node_id} ({config.host}): {exc}") from None
    kv_dtype = kv_cache_torch_dtype(ec)
    # The model comes first: FP8 KV scales are calibrated on it, and they belong to the layout
    # the transport checks when a prefill worker connects (deterministic, so equal configs pair).
    # load_model refuses FP8 on a GPU without native FP8 before any kernel runs.
    model, plan, ec = load_sharded_model(model_dir, ec, group)  # the whole model at size 1
    model_config = plan.model_config
    kv_heads = plan.kv_heads if group.size > 1 else None
    kv_scales = kv_cache_scales(model, ec)  # calibrated by load_sharded_model for an FP8 cache
    # On a GPU without --kv-cache-memory: --gpu-memory-utilization less the weights and the profiled activation peak.
    num_blocks = kv_cache_num_blocks(model, model_config, ec, ec.max_model_len)
    if reslices_heads(config, plan.model_kv_heads, group.rank):
        num_blocks = max(1, num_blocks // 2)  # the staging or inlet caches take as much again at most
    num_blocks = group.all_min(num_blocks)
    layout = KVLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=ec.block_size,
        dtype=dtype_name(kv_dtype),
        kv_scales=kv_scales,
        layer_windows=model_config.layer_windows,
        tp_size=group.size,
        kv_heads=kv_heads,
    )
    place = Place(config.node_id, config.host, "cuda" if ec.device.startswith("cuda") else "cpu")
    name = config.worker_id if group.rank == 0 else f"{config.worker_id}.tp{group.rank}"
    transport = PairwiseTransport(config.transport, place, name)
    kv_cache = transport.allocate_cache(layout, num_blocks)
    kv = RankKV(
        transport,
        kv_cache,
        layout,
        group.rank,
        plan.model_kv_heads,
        lambda part: PairwiseTransport(config.transport, place, f"{name}.{part}"),
        config.peer_tp_size if config.role == Role.DECODE else None,
    )
    return RankShard(model_dir, model_config, ec, model, kv, kv_cache, plan.lora_sharding())


def reslices_heads(config: WorkerConfig, model_kv_heads: int, rank: int) -> bool:
    """Whether a rank's handoffs move a part of its KV heads (the peer pool's ranks are finer), and
    so need a staging or inlet cache beside its own."""
    peer = config.peer_tp_size or config.tp_size
    if peer == config.tp_size:
        return False
    own_heads = kv_head_range(model_kv_heads, config.tp_size, rank)
    if config.role == Role.PREFILL:
        links = [link for link in handoff_links(model_kv_heads, config.tp_size, peer) if link.src_rank == rank]
    else:
        links = [link for link in handoff_links(model_kv_heads, peer, config.tp_size) if link.dst_rank == rank]
    return any(link.heads != own_heads for link in links)
