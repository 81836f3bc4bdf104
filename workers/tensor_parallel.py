"""Tensor parallelism inside a worker: a group of ranks that each hold a shard of every layer.

`ShardPlan` says what rank r of a TP group of size N holds, from the model's ModelConfig alone:
its query heads (an even split), its KV heads (an even split when num_kv_heads >= N; when N
exceeds num_kv_heads each rank keeps the one KV head its query heads read, rank * num_kv_heads
// N, so a head is replicated N // num_kv_heads times, as vLLM does) and its slice of the MLP's
intermediate dimension. `ShardPlan.model_config` is the rank's view of the model (its head and
intermediate counts): the model, its KV cache and the attention kernels are built from it
unchanged, so the KV cache of a rank holds only its KV heads.

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

Phase 1 (this module): each rank runs its own LLMEngine (`build_engine`) in lockstep on the same
requests (SPMD): identical inputs make identical scheduler decisions, and rank 0's tokens are the
answer (`lockstep_generate` runs the ranks as processes on one machine, gloo on 127.0.0.1). Phase
2 replaces lockstep by rank 0 scheduling and broadcasting each step to the other ranks.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.net import free_port
from common.sampling_params import SamplingParams
from workers import model_runner
from workers.config import EngineConfig
from workers.engine import LLMEngine, load_tokenizer_decode
from workers.grammar import GrammarCache
from workers.model_config import ModelConfig

# Row-parallel projections (input columns split, output summed over ranks).
ROW_PARALLEL = ("o_proj", "down_proj")


class TPGroup:
    """This process's place in a tensor-parallel group and the group's one collective.

    Size 1 (`TPGroup.single()`) needs no torch.distributed: all_reduce returns its input. A larger
    group is one torch.distributed process group per process (gloo on the CPU, NCCL on CUDA),
    made by `TPGroup.connect`; `close` tears it down.
    """

    def __init__(self, rank: int, size: int, backend: str | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"TP rank {rank} is outside a group of size {size}")
        self.rank = rank
        self.size = size
        self.backend = backend

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(0, 1)

    @classmethod
    def connect(cls, rank: int, size: int, init_method: str, device: str = "cpu",
                timeout_s: float = 120.0) -> "TPGroup":
        """Join the group every rank names with the same init_method (e.g. tcp://127.0.0.1:PORT)."""
        if size == 1:
            return cls.single()
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, size, backend)

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

    @classmethod
    def of(cls, config: ModelConfig, tp_size: int, rank: int) -> "ShardPlan":
        if tp_size < 1 or not 0 <= rank < tp_size:
            raise ValueError(f"need tensor_parallel_size >= 1 and 0 <= rank < it, got size {tp_size}, rank {rank}")
        heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
        if heads % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {heads} query heads")
        if inter % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's intermediate_size {inter}")
        if config.num_experts:
            raise ValueError(f"{config.architecture}: tensor parallelism of mixture-of-experts models is not supported")
        if kv >= tp_size:
            if kv % tp_size:
                raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {kv} KV heads")
            per_rank = kv // tp_size
            kv_heads = (rank * per_rank, (rank + 1) * per_rank)
        else:
            if tp_size % kv:
                raise ValueError(f"tensor_parallel_size {tp_size} exceeds the model's {kv} KV heads and is not a "
                                 f"multiple of it (each KV head must be replicated on the same number of ranks)")
            head = rank * kv // tp_size
            kv_heads = (head, head + 1)
        q_per_rank, i_per_rank = heads // tp_size, inter // tp_size
        shard = dataclasses.replace(config, num_heads=q_per_rank, num_kv_heads=kv_heads[1] - kv_heads[0],
                                    intermediate_size=i_per_rank)
        return cls(rank, tp_size, config.head_dim, (rank * q_per_rank, (rank + 1) * q_per_rank), kv_heads,
                   (rank * i_per_rank, (rank + 1) * i_per_rank), tp_size > kv, shard)

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
            raise ValueError(f"FP8 checkpoints with block scales (weight_block_size {block}) are not supported with "
                             f"tensor parallelism yet; per-channel and per-tensor scales are")

    def __iter__(self):
        for name, tensor in self.weights:
            yield name, self.shard(name, tensor)

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
            return tensor  # norms, per-tensor scales, static activation scales
        if proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            rows = {"q_proj": plan.q_rows, "k_proj": plan.kv_rows, "v_proj": plan.kv_rows}.get(proj, plan.intermediate_rows)
            return tensor[rows].contiguous()
        if proj == "qkv_proj":  # Phi-3's fused checkpoint: [q; k; v]
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            pieces = (tensor[:q][plan.q_rows], tensor[q : q + kv][plan.kv_rows], tensor[q + kv :][plan.kv_rows])
            return torch.cat(pieces).contiguous()
        if proj == "gate_up_proj":  # Phi-3's fused checkpoint: [gate; up]
            inter = cfg.intermediate_size
            return torch.cat((tensor[:inter][plan.intermediate_rows], tensor[inter:][plan.intermediate_rows])).contiguous()
        if proj in ROW_PARALLEL:
            if kind == "bias":  # added once, on rank 0, to the summed output
                return tensor if plan.rank == 0 else torch.zeros_like(tensor)
            if kind != "weight":
                return tensor  # per-output-channel scales: the output rows are not split
            columns = plan.q_rows if proj == "o_proj" else plan.intermediate_rows
            return tensor[:, columns].contiguous()
        return tensor


def load_sharded_model(model_dir: str | os.PathLike, engine_config: EngineConfig,
                       group: TPGroup) -> tuple[torch.nn.Module, ShardPlan, EngineConfig]:
    """The rank's shard of the model in model_dir, its ShardPlan and the engine config to run it
    with (an FP8 KV cache's scales calibrated on this rank's heads, as a prebuilt model needs)."""
    config = ModelConfig.from_model_dir(model_dir)
    plan = ShardPlan.of(config, group.size, group.rank)
    weights = ShardedCheckpoint(model_runner.iter_safetensors(Path(model_dir)), config, plan)
    max_len = engine_config.max_model_len or config.max_position_embeddings
    model = model_runner.load_model(plan.model_config, engine_config, weights, max_len,
                                    tp_group=group if group.size > 1 else None)
    if engine_config.kv_cache_dtype == "fp8" and engine_config.kv_scales is None:
        scales = model_runner.kv_cache_scales(model, engine_config, weights)
        engine_config = dataclasses.replace(engine_config, kv_scales=scales)
    return model, plan, engine_config


def build_engine(model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup) -> LLMEngine:
    """An LLMEngine on this rank's shard of the model in model_dir (the whole model at size 1)."""
    model, plan, engine_config = load_sharded_model(model_dir, engine_config, group)
    cfg = plan.model_config
    return LLMEngine(cfg, engine_config, model, load_tokenizer_decode(Path(model_dir)),
                     grammars=GrammarCache(Path(model_dir), cfg.vocab_size, cfg.eos_token_ids))


@dataclass(frozen=True)
class LockstepJob:
    """Prompts to run to completion on one model; every rank runs the same job."""

    model_dir: str
    prompts: list[list[int]]
    max_tokens: int
    decode_steps_to_time: int = 0  # then also time this many single-stream decode steps of prompts[0]
    record_logits: bool = False  # return the float32 logits each token was sampled from


@dataclass(frozen=True)
class RankResult:
    rank: int
    token_ids: list[list[int]]  # per prompt, greedy
    decode_step_seconds: list[float]  # wall time of each timed decode step (empty unless asked)
    logits: list[torch.Tensor] | None = None  # per prompt [tokens, vocab] when the job records them


def _run_rank(rank: int, size: int, init_method: str, jobs: list[LockstepJob], engine_config: EngineConfig,
              out_dir: str) -> None:
    """One rank's process: join the group, run every job on its shard, save its results to out_dir."""
    torch.set_num_threads(1)  # an EngineConfig.num_threads overrides it
    group = TPGroup.connect(rank, size, init_method, engine_config.device)
    try:
        results = []
        for job in jobs:
            engine = build_engine(job.model_dir, engine_config, group)
            greedy = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
            logits = {tuple(p): [] for p in job.prompts}
            if job.record_logits:
                engine.sampler = _recording(engine.sampler, logits)
            tokens = [c.token_ids for c in engine.generate(job.prompts, greedy)]
            seconds: list[float] = []

            def time_single_stream_decode(chunks, wall_s: float) -> None:
                if [tokens_this_step for _, tokens_this_step, _ in chunks] == [1]:
                    seconds.append(wall_s)

            if job.decode_steps_to_time:
                stop = engine.observe_steps(time_single_stream_decode)
                engine.generate(job.prompts[:1], dataclasses.replace(greedy, max_tokens=job.decode_steps_to_time + 1))
                stop()
            results.append({"token_ids": tokens, "decode_step_seconds": seconds,
                            "logits": [torch.stack(logits[tuple(p)]) for p in job.prompts] if job.record_logits else None})
        torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    finally:
        group.close()


def _recording(sampler, logits: dict[tuple[int, ...], list[torch.Tensor]]):
    """sampler, also appending each row's logits to logits[its prompt]."""
    def sample(step_logits: torch.Tensor, rows):
        for row_logits, row in zip(step_logits, rows):
            logits[tuple(row.prompt_token_ids)].append(row_logits.detach().clone())
        return sampler(step_logits, rows)
    return sample


def lockstep_generate(jobs: list[LockstepJob], tp_size: int, engine_config: EngineConfig) -> list[list[RankResult]]:
    """Run the jobs on tp_size rank processes in lockstep (gloo on 127.0.0.1); per job, each rank's result."""
    with tempfile.TemporaryDirectory(prefix="baton-tp-") as out_dir:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(_run_rank, args=(tp_size, init_method, jobs, engine_config, out_dir), nprocs=tp_size,
                           join=True, start_method="spawn")
        per_rank = [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(tp_size)]
    return [[RankResult(r, **per_rank[r][j]) for r in range(tp_size)] for j in range(len(jobs))]
