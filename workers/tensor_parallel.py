"""Tensor parallelism inside a worker: a group of ranks that each hold a shard of every layer.

`ShardPlan` says what rank r of a TP group of size N holds, from the model's ModelConfig alone:
its query heads (an even split), its KV heads (an even split when num_kv_heads >= N; when N
exceeds num_kv_heads each rank keeps the one KV head its query heads read, rank * num_kv_heads
// N, so a head is replicated N // num_kv_heads times, as vLLM does) and its slice of the MLP's
intermediate dimension. `ShardPlan.model_config` is the rank's view of the model (its head and
intermediate counts): the model, its KV cache and the attention kernels are built from it
unchanged, so the KV cache of a rank holds only its KV heads.

Mixture-of-experts models keep the router whole on every rank and split the experts by their
intermediate channels (each rank every expert's 1/N, like a dense MLP) or, with expert parallelism,
whole (each rank 1/N of the experts, `ModelConfig.local_experts`); workers/models/moe.py says how
each runs.

`ShardedCheckpoint` slices the Hugging Face tensors on the way into `load_hf_weights`:
column-parallel q/k/v and gate/up keep the rank's output rows (Qwen2's q/k/v biases and FP8
per-channel weight scales with them), row-parallel o_proj and down_proj keep the rank's input
columns, and their biases are kept on rank 0 only (zeros elsewhere) so the one all-reduce after
each (`TPGroup.all_reduce`, which the model's Attention and MLP call) adds them once. Qwen3's
q/k norms are per head_dim, so every rank keeps them whole.

The embedding and lm_head are replicated, not vocab-parallel: the vocabularies served here are
small next to the layers, replication needs no all-gather of logits, and since every rank's
hidden states are the same after the last all-reduce, every rank computes the same logits and
samples the same token, so rank 0's sample is every rank's.

Only rank 0 schedules: its LLMEngine (block manager, scheduler, sampler) is the worker as the
router sees it. Its ModelRunner broadcasts each step's inputs (`StepInputs`, plain lists) to the
other ranks before running the step; they run the same forward pass on their shards
(`ModelRunner.follow`), joined by the all-reduces, and compute no logits. The KV block ids
rank 0's block manager picks index every rank's cache alike, so a rank's cache holds its heads of
the same blocks. `workers.tp_rank` is a non-zero rank as a worker process; `workers.actors`
places the ranks of one worker on one node (a placement group).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.tp_split import check_tp_split, kv_head_range
from workers import model_runner
from workers.config import EngineConfig
from workers.engine import LLMEngine, load_tokenizer_decode
from workers.grammar import GrammarCache
from workers.model_config import ModelConfig

# Row-parallel projections (input columns split, output summed over ranks).
ROW_PARALLEL = ("o_proj", "down_proj")


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


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of a TP group of `tp_size` holds; ranges are [start, stop) in heads or channels."""

    rank: int
    tp_size: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    kv_replicated: bool  # tp_size > num_kv_heads: this rank's KV head is also on other ranks
    model_config: ModelConfig  # the rank's view: its head and intermediate counts
    experts: tuple[int, int] = (0, 0)  # the experts it holds (all of them unless expert parallel)
    moe_intermediate: tuple[int, int] = (0, 0)  # its channels of each expert's intermediate dimension
    model_kv_heads: int = 0  # the whole model's KV heads

    @property
    def expert_parallel(self) -> bool:
        """Whether the rank holds a share of the experts whole (rather than of every expert's channels)."""
        return self.model_config.local_experts is not None

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, rank: int, expert_parallel: bool = False) -> ShardPlan:
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ValueError(f"need tensor_parallel_size >= 1 and 0 <= rank < it, got size {tp_size}, rank {rank}")
        heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        check_tp_split(
            tp_size,
            heads,
            kv,
            inter,
            config.num_experts,
            config.moe_intermediate_size,
            expert_parallel,
            dense_mlps=not config.num_experts or bool(config.dense_mlp_layers),
        )
        experts, moe_inter = (0, config.num_experts), (0, config.moe_intermediate_size)
        if config.num_experts and expert_parallel:
            per = config.num_experts // tp_size
            experts = (rank * per, (rank + 1) * per)
        elif config.num_experts:
            per = config.moe_intermediate_size // tp_size
            moe_inter = (rank * per, (rank + 1) * per)
        kv_heads = kv_head_range(kv, tp_size, rank)
        q_per_rank, i_per_rank = heads // tp_size, inter // tp_size
        shard = dataclasses.replace(
            config,
            num_heads=q_per_rank,
            num_kv_heads=kv_heads[1] - kv_heads[0],
            intermediate_size=i_per_rank,
            moe_intermediate_size=moe_inter[1] - moe_inter[0],
            local_experts=experts if config.num_experts and expert_parallel and tp_size > 1 else None,
        )
        return cls(
            rank,
            tp_size,
            config.head_dim,
            (rank * q_per_rank, (rank + 1) * q_per_rank),
            kv_heads,
            (rank * i_per_rank, (rank + 1) * i_per_rank),
            tp_size > kv,
            shard,
            experts,
            moe_inter,
            kv,
        )

    @property
    def q_rows(self) -> slice:
        """The rank's rows of q_proj (its columns of o_proj)."""
        return slice(self.q_heads[0] * self.head_dim, self.q_heads[1] * self.head_dim)

    @property
    def kv_rows(self) -> slice:
        """The rank's rows of k_proj and v_proj."""
        return slice(self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim)

    @property
    def intermediate_rows(self) -> slice:
        """The rank's rows of gate_proj and up_proj (its columns of down_proj)."""
        return slice(*self.intermediate)


class ShardedCheckpoint:
    """A checkpoint's (name, tensor) pairs cut to one rank's shard (see the module docstring).

    Keeps the attributes the loader reads from a checkpoint (model_dir, quantization_config).
    """

    def __init__(self, weights, config: ModelConfig, plan: ShardPlan) -> None:
        self.weights = weights
        self.config = config
        self.plan = plan
        self.model_dir = getattr(weights, "model_dir", None)
        self.quantization_config = getattr(weights, "quantization_config", None)
        block = (self.quantization_config or {}).get("weight_block_size")
        if block and plan.tp_size > 1:
            raise ValueError(
                f"FP8 checkpoints with block scales (weight_block_size {block}) are not supported with "
                f"tensor parallelism yet; per-channel and per-tensor scales are"
            )

    def __iter__(self):
        for name, tensor in self.weights:
            if self.plan.tp_size > 1 and ".experts." in name:
                piece = self.expert(name, tensor)
                if piece is not None:
                    yield piece
                continue
            yield name, self.shard(name, tensor)

    def expert(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The rank's part of an expert tensor, under the name the loader reads (with expert
        parallelism a kept expert is renumbered from 0); None: an expert this rank does not hold.

        Per expert: `...experts.{e}.{w1|w3|gate_proj|up_proj}.weight` [I, H] and `{w2|down_proj}` [H, I];
        fused: `...experts.gate_up_proj` [E, 2I, H] and `...experts.down_proj` [E, H, I]."""
        plan = self.plan
        head, _, rest = name.partition(".experts.")
        parts = rest.split(".")
        if parts[0].isdigit():  # one expert's projection
            e, proj = int(parts[0]), parts[1]
            if plan.expert_parallel:
                if not plan.experts[0] <= e < plan.experts[1]:
                    return None
                return f"{head}.experts.{e - plan.experts[0]}.{'.'.join(parts[1:])}", tensor
            cut = slice(*plan.moe_intermediate)
            return name, (tensor[:, cut] if proj in ("w2", "down_proj") else tensor[cut]).contiguous()
        if plan.expert_parallel:
            return name, tensor[slice(*plan.experts)].contiguous()
        cut, inter = slice(*plan.moe_intermediate), self.config.moe_intermediate_size
        if parts[0] == "gate_up_proj":
            return name, torch.cat((tensor[:, :inter][:, cut], tensor[:, inter:][:, cut]), dim=1).contiguous()
        return name, tensor[:, :, cut].contiguous()  # down_proj

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of checkpoint tensor `name`."""
        plan, cfg = self.plan, self.config
        if plan.tp_size == 1:
            return tensor
        parts = name.split(".")
        if len(parts) < 2 or "layers" not in parts:
            return tensor  # embedding, final norm, lm_head: replicated
        proj, kind = parts[-2], parts[-1]
        per_row = kind in ("weight", "bias") or (kind.startswith("weight_scale") and tensor.numel() > 1)
        if not per_row:
            return tensor  # norms, per-tensor scales, static activation scales, an MoE router
        if proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            rows = {"q_proj": plan.q_rows, "k_proj": plan.kv_rows, "v_proj": plan.kv_rows}.get(
                proj, plan.intermediate_rows
            )
            return tensor[rows].contiguous()
        if proj == "qkv_proj":  # Phi-3's fused checkpoint: [q; k; v]
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            pieces = (tensor[:q][plan.q_rows], tensor[q : q + kv][plan.kv_rows], tensor[q + kv :][plan.kv_rows])
            return torch.cat(pieces).contiguous()
        if proj == "gate_up_proj":  # Phi-3's fused checkpoint: [gate; up]
            inter = cfg.intermediate_size
            return torch.cat(
                (tensor[:inter][plan.intermediate_rows], tensor[inter:][plan.intermediate_rows])
            ).contiguous()
        if proj in ROW_PARALLEL:
            if kind == "bias":  # added once, on rank 0, to the summed output
                return tensor if plan.rank == 0 else torch.zeros_like(tensor)
            if kind != "weight":
                return tensor  # per-output-channel scales: the output rows are not split
            columns = plan.q_rows if proj == "o_proj" else plan.intermediate_rows
            return tensor[:, columns].contiguous()
        return tensor


def load_sharded_model(
    model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup
) -> tuple[torch.nn.Module, ShardPlan, EngineConfig]:
    """The rank's shard of the model in model_dir, its ShardPlan and the engine config to run it
    with (an FP8 KV cache's scales calibrated over every rank's heads: the largest of the ranks',
    so that they are those of the whole model whatever the group's size, and FP8 blocks pair
    between groups of different sizes)."""
    config = ModelConfig.from_model_dir(model_dir)
    plan = ShardPlan.of(config, group.size, group.rank, engine_config.enable_expert_parallel)
    weights = ShardedCheckpoint(model_runner.iter_safetensors(Path(model_dir)), config, plan)
    max_len = engine_config.max_model_len or config.max_position_embeddings
    model = model_runner.load_model(
        plan.model_config, engine_config, weights, max_len, tp_group=group if group.size > 1 else None
    )
    if engine_config.kv_cache_dtype == "fp8" and engine_config.kv_scales is None:
        scales = model_runner.kv_cache_scales(model, engine_config, weights)
        flat = group.all_max([s for pair in scales for s in pair])
        scales = tuple(zip(flat[0::2], flat[1::2]))
        engine_config = dataclasses.replace(engine_config, kv_scales=scales)
    return model, plan, engine_config


def build_engine(model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup) -> LLMEngine:
    """Rank 0: an LLMEngine on its shard of the model in model_dir (the whole model at size 1)
    that broadcasts every step to the other ranks (which run `build_follower(...).follow()`)."""
    model, plan, engine_config = load_sharded_model(model_dir, engine_config, group)
    cfg = plan.model_config
    kv_cache = _shared_size_cache(model, cfg, engine_config, group)
    return LLMEngine(
        cfg,
        engine_config,
        model,
        load_tokenizer_decode(Path(model_dir)),
        kv_cache=kv_cache,
        grammars=GrammarCache(Path(model_dir), cfg.vocab_size, cfg.eos_token_ids),
        tp_group=group,
    )


def build_follower(
    model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup
) -> model_runner.ModelRunner:
    """A non-zero rank: the ModelRunner of its shard, to `follow()` rank 0's steps."""
    model, plan, engine_config = load_sharded_model(model_dir, engine_config, group)
    kv_cache = _shared_size_cache(model, plan.model_config, engine_config, group)
    return model_runner.ModelRunner(plan.model_config, engine_config, model, kv_cache=kv_cache, tp_group=group)


def _shared_size_cache(model, config: ModelConfig, engine_config: EngineConfig, group: TPGroup) -> torch.Tensor:
    """This rank's KV cache with as many blocks as every rank's (rank 0's block ids index them all)."""
    max_len = engine_config.max_model_len or config.max_position_embeddings
    num_blocks = group.all_min(model_runner.kv_cache_num_blocks(model, config, engine_config, max_len))
    shape = (config.num_layers, 2, num_blocks, engine_config.block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(
        shape, dtype=model_runner.kv_cache_torch_dtype(engine_config), device=torch.device(engine_config.device)
    )
