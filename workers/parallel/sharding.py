"""What a rank of a tensor-parallel group holds (ShardPlan), a checkpoint cut to it
(ShardedCheckpoint), and the rank's model loaded from its shard (load_sharded_model); the package
docstring, workers.parallel, says how each layer is split."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from common.tp_split import check_tp_split, kv_head_range
from workers.config import EngineConfig
from workers.engine.loader import kv_cache_scales, load_model
from workers.lora.adapter import LoRASharding
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.llama import LlamaForCausalLM
from workers.parallel.group import TPGroup

# Row-parallel projections (input columns split, output summed over ranks).
ROW_PARALLEL = ("o_proj", "down_proj")


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

    def lora_sharding(self) -> LoRASharding:
        """The rank's cut of LoRA adapters (workers.lora): B's rows of q/k/v/gate/up, A's columns of o/down."""
        shard = self.model_config
        full = dataclasses.replace(
            shard,
            num_heads=shard.num_heads * self.tp_size,
            num_kv_heads=self.model_kv_heads or shard.num_kv_heads,
            intermediate_size=shard.intermediate_size * self.tp_size,
            local_experts=None,
        )
        if self.tp_size == 1:
            return LoRASharding(full, {})
        inter = self.intermediate_rows
        cuts = {"q_proj": self.q_rows, "k_proj": self.kv_rows, "v_proj": self.kv_rows, "o_proj": self.q_rows}
        cuts |= {"gate_proj": inter, "up_proj": inter, "down_proj": inter}
        return LoRASharding(full, cuts)

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
    model_dir: str | os.PathLike[str], engine_config: EngineConfig, group: TPGroup
) -> tuple[LlamaForCausalLM, ShardPlan, EngineConfig]:
    """The rank's shard of the model in model_dir, its ShardPlan and the engine config to run it
    with (an FP8 KV cache's scales calibrated over every rank's heads: the largest of the ranks',
    so that they are those of the whole model whatever the group's size, and FP8 blocks pair
    between groups of different sizes)."""
    config = ModelConfig.from_model_dir(Path(model_dir))
    plan = ShardPlan.of(config, group.size, group.rank, engine_config.enable_expert_parallel)
    weights = ShardedCheckpoint(iter_safetensors(Path(model_dir)), config, plan)
    max_len = engine_config.max_model_len or config.max_position_embeddings
    model = load_model(plan.model_config, engine_config, weights, max_len, tp_group=group if group.size > 1 else None)
    if engine_config.kv_cache_dtype == "fp8" and engine_config.kv_scales is None:
        scales = kv_cache_scales(model, engine_config, weights)
        flat = group.all_max([s for pair in scales for s in pair])
        scales = tuple(zip(flat[0::2], flat[1::2]))
        engine_config = dataclasses.replace(engine_config, kv_scales=scales)
    return model, plan, engine_config
