"""Tensor-parallel groups as plain processes on one machine, for tests and `bench/tp.py`: each job's
prompts run to completion on a group of ranks joined by gloo on 127.0.0.1, rank 0 scheduling and
broadcasting its steps exactly as a served worker's group does (workers.parallel).

`build_tp_engine` and `build_tp_follower` build a rank straight from a model folder (its shard and
a KV cache as large as every rank's), without a worker's KV transport (workers.parallel.shard).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from common.net import free_port
from common.protocol import ResumeState
from common.request import RequestContext
from common.sampling_params import SamplingParams
from workers.build import build_engine, load_tokenizer_decode
from workers.config import EngineConfig
from workers.engine.grammar import GrammarCache
from workers.engine.kv_cache import kv_cache_num_blocks, kv_cache_torch_dtype
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner
from workers.models.config import ModelConfig
from workers.parallel.group import TPGroup
from workers.parallel.sharding import load_sharded_model


@dataclass(frozen=True)
class GroupJob:
    """Prompts to run to completion on one model, greedy."""

    model_dir: str
    prompts: list[list[int]]
    max_tokens: int
    decode_steps_to_time: int = 0  # then also time this many single-stream decode steps of prompts[0]
    record_logits: bool = False  # return the float32 logits each token was sampled from
    # Continue each prompt from these tokens, as a request migrated from a lost worker goes on
    # (LLMEngine.resume_request): token_ids are then the tokens after them, up to max_tokens in all.
    resume_from: list[list[int]] | None = None
    adapters: list[str | None] | None = None  # each prompt's LoRA adapter (EngineConfig's lora_modules)


@dataclass(frozen=True)
class GroupResult:
    token_ids: list[list[int]]  # per prompt, greedy (rank 0's samples)
    decode_step_seconds: list[float]  # wall time of each timed decode step (empty unless asked)
    logits: list[torch.Tensor] | None  # per prompt [tokens, vocab] when the job records them
    steps_run: list[int]  # per rank: the forward passes it ran (every rank runs each of rank 0's steps)


def build_tp_engine(model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup) -> LLMEngine:
    """Rank 0: an LLMEngine on its shard of the model in model_dir (the whole model at size 1)
    that broadcasts every step to the other ranks (which run `build_tp_follower(...).follow()`)."""
    model, plan, engine_config = load_sharded_model(model_dir, engine_config, group)
    cfg = plan.model_config
    kv_cache = _shared_size_cache(model, cfg, engine_config, group)
    return build_engine(
        cfg,
        engine_config,
        model,
        load_tokenizer_decode(Path(model_dir)),
        kv_cache=kv_cache,
        grammars=GrammarCache(Path(model_dir), cfg.vocab_size, cfg.eos_token_ids),
        tp_group=group,
        lora_sharding=plan.lora_sharding(),
    )


def build_tp_follower(model_dir: str | os.PathLike, engine_config: EngineConfig, group: TPGroup) -> ModelRunner:
    """A non-zero rank: the ModelRunner of its shard, to `follow()` rank 0's steps."""
    model, plan, engine_config = load_sharded_model(model_dir, engine_config, group)
    kv_cache = _shared_size_cache(model, plan.model_config, engine_config, group)
    return ModelRunner(
        plan.model_config, engine_config, model, kv_cache=kv_cache, tp_group=group, lora_sharding=plan.lora_sharding()
    )


def _shared_size_cache(model, config: ModelConfig, engine_config: EngineConfig, group: TPGroup) -> torch.Tensor:
    """This rank's KV cache with as many blocks as every rank's (rank 0's block ids index them all)."""
    max_len = engine_config.max_model_len or config.max_position_embeddings
    num_blocks = group.all_min(kv_cache_num_blocks(model, config, engine_config, max_len))
    shape = (config.num_layers, 2, num_blocks, engine_config.block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=kv_cache_torch_dtype(engine_config), device=torch.device(engine_config.device))


def _run_rank(
    rank: int, size: int, init_method: str, jobs: list[GroupJob], engine_config: EngineConfig, out_dir: str
) -> None:
    """One rank's process: join the group, run every job (rank 0 schedules, the others follow)."""
    torch.set_num_threads(1)  # an EngineConfig.num_threads overrides it
    group = TPGroup.connect(rank, size, init_method, engine_config.device)
    try:
        results = []
        for job in jobs:
            if rank > 0:
                results.append({"steps": build_tp_follower(job.model_dir, engine_config, group).follow()})
                continue
            results.append(_lead(job, build_tp_engine(job.model_dir, engine_config, group)))
        torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    finally:
        group.close()


def _lead(job: GroupJob, engine) -> dict:
    """Rank 0's part of one job: generate, then end the other ranks' steps."""
    greedy = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
    logits = {tuple(p): [] for p in job.prompts}
    if job.record_logits:
        engine.sampler = _recording(engine.sampler, logits)
    steps = [0]
    engine.observe_steps(lambda chunks, wall_s: steps.__setitem__(0, steps[0] + 1))
    if job.adapters is not None:
        tokens = _under_adapters(engine, job, greedy)
    elif job.resume_from is None:
        tokens = [c.token_ids for c in engine.generate(job.prompts, greedy)]
    else:
        tokens = _resumed(engine, job, greedy)
    seconds: list[float] = []

    def time_single_stream_decode(chunks, wall_s: float) -> None:
        if [tokens_this_step for _, tokens_this_step, _ in chunks] == [1]:
            seconds.append(wall_s)

    if job.decode_steps_to_time:
        stop = engine.observe_steps(time_single_stream_decode)
        engine.generate(job.prompts[:1], dataclasses.replace(greedy, max_tokens=job.decode_steps_to_time + 1))
        stop()
    engine.runner.stop_followers()
    return {
        "token_ids": tokens,
        "decode_step_seconds": seconds,
        "steps": steps[0],
        "logits": [torch.stack(logits[tuple(p)]) for p in job.prompts] if job.record_logits else None,
    }


def _resumed(engine, job: GroupJob, greedy: SamplingParams) -> list[list[int]]:
    """Continue each prompt after job.resume_from's tokens; the tokens each then produces."""
    ids = [f"resumed-{i}" for i in range(len(job.prompts))]
    for rid, prompt, done in zip(ids, job.prompts, job.resume_from):
        engine.resume_request(prompt, greedy, rid, ResumeState(tuple(done), 0))
    return drain(engine, ids)


def _under_adapters(engine, job: GroupJob, greedy: SamplingParams) -> list[list[int]]:
    """Run each prompt under its LoRA adapter (job.adapters), all in one continuous batch."""
    assert job.adapters is not None
    ids = [
        engine.add_request(p, greedy, context=RequestContext(f"lora-{i}", adapter=a))
        for i, (p, a) in enumerate(zip(job.prompts, job.adapters))
    ]
    return drain(engine, ids)


def drain(engine, ids: list[str]) -> list[list[int]]:
    """Step the engine until the requests `ids` finish; each one's tokens."""
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = set(ids)
    while pending:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return [tokens[rid] for rid in ids]


def _recording(sampler, logits: dict[tuple[int, ...], list[torch.Tensor]]):
    """sampler, also appending each row's logits to logits[its prompt]."""

    def sample(step_logits: torch.Tensor, rows):
        for row_logits, row in zip(step_logits, rows):
            logits[tuple(row.prompt_token_ids)].append(row_logits.detach().clone())
        return sampler(step_logits, rows)

    return sample


def run_group(jobs: list[GroupJob], tp_size: int, engine_config: EngineConfig) -> list[GroupResult]:
    """Run the jobs on a group of tp_size rank processes (gloo on 127.0.0.1); one result per job."""
    with tempfile.TemporaryDirectory(prefix="baton-tp-") as out_dir:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(
            _run_rank,
            args=(tp_size, init_method, jobs, engine_config, out_dir),
            nprocs=tp_size,
            join=True,
            start_method="spawn",
        )
        per_rank = [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(tp_size)]
    lead = per_rank[0]
    return [
        GroupResult(
            lead[j]["token_ids"],
            lead[j]["decode_step_seconds"],
            lead[j]["logits"],
            [per_rank[r][j]["steps"] for r in range(tp_size)],
        )
        for j in range(len(jobs))
    ]
