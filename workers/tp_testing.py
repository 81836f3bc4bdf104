"""Tensor-parallel groups as plain processes on one machine, for tests and `bench/tp.py`: each job's
prompts run to completion on a group of ranks joined by gloo on 127.0.0.1, rank 0 scheduling and
broadcasting its steps exactly as a served worker's group does (workers.tensor_parallel).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from common.net import free_port
from common.protocol import ResumeState
from common.sampling_params import SamplingParams
from workers.config import EngineConfig
from workers.tensor_parallel import TPGroup, build_engine, build_follower


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


@dataclass(frozen=True)
class GroupResult:
    token_ids: list[list[int]]  # per prompt, greedy (rank 0's samples)
    decode_step_seconds: list[float]  # wall time of each timed decode step (empty unless asked)
    logits: list[torch.Tensor] | None  # per prompt [tokens, vocab] when the job records them
    steps_run: list[int]  # per rank: the forward passes it ran (every rank runs each of rank 0's steps)


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
                results.append({"steps": build_follower(job.model_dir, engine_config, group).follow()})
                continue
            results.append(_lead(job, build_engine(job.model_dir, engine_config, group)))
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
    if job.resume_from is None:
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
