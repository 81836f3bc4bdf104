"""The draft_model proposer: a smaller model with the same tokenizer guesses the next tokens greedily.

The draft runs on its own ModelRunner beside the target's, with a paged KV cache of its own indexed
by the same block ids: a sequence's draft KV at position p sits in block seq.block_ids[p // block]
of the draft's cache, as the target's does in the target's. So the block manager's allocations,
prefix-cache sharing (equal tokens give equal draft KV) and releases serve both caches, and nothing
is allocated per request. The draft's own positions past the target's blocks (its guesses beyond
the sequence's last allocated block) go to scratch blocks after the shared ones, one run per
sequence in the batch; the target never sees them.

Each proposal, batched over the step's drafting sequences:
1. catch up: the draft runs over the sequence's tokens it has no KV for (its whole prompt on the
   first proposal, as after a remote prefill or a migration; afterwards the token the target emitted
   last and whatever the last verification accepted past the scratch), and takes the argmax of its
   last row as the first draft;
2. then k - 1 single-token steps, each feeding the previous draft.

What the draft has KV for is kept as the tokens it ran and the block ids they were in; the next
proposal keeps the longest prefix that still matches the sequence's tokens and blocks (so rejected
drafts, scratch positions, a preemption's new blocks and a prefix-cache block that went elsewhere are
all recomputed, never trusted).

Drafts are point masses (the draft's argmax), so verification is the engine's rejection rule for a
point-mass proposal (workers/speculative.py) and the output distribution is unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.config import EngineConfig, SpeculativeConfig
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner, iter_safetensors, kv_cache_torch_dtype, model_bytes
from workers.sequence import ScheduledChunk, Sequence


@dataclass
class DraftView:
    """A sequence as the draft's ModelRunner reads it (the attributes StepInputs.of uses)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class DraftCacheState:
    """The tokens the draft has KV for, in order from position 0, and the block ids they were written to."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0  # the sequence's, when written: a preemption frees the blocks, whatever ids come back

    def valid_prefix(self, seq: Sequence, block_size: int) -> int:
        """How many leading positions of seq still have the draft's KV: tokens equal and in the same blocks."""
        if seq.num_preemptions != self.num_preemptions:
            return 0
        n = 0
        for mine, theirs in zip(self.token_ids, seq.token_ids):
            if mine != theirs:
                break
            n += 1
        blocks = 0
        while blocks < len(self.block_ids) and blocks < len(seq.block_ids) and self.block_ids[blocks] == seq.block_ids[blocks]:
            blocks += 1
        return min(n, blocks * block_size)


def load_draft(config: SpeculativeConfig, target: ModelConfig) -> tuple[ModelConfig, Path]:
    """The draft's model config, checked against the target's (same vocabulary); ValueError naming `model`."""
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model {config.model!r} is not a model folder (no config.json)")
    draft = ModelConfig.from_model_dir(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the served model "
                         f"{target.vocab_size}: the draft must share the target's tokenizer")
    return draft, path


class DraftModelProposer:
    """Greedy drafts from a smaller model (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, target: ModelConfig, engine_config: EngineConfig,
                 num_blocks: int, max_model_len: int, target_bytes: int) -> None:
        draft_config, path = load_draft(config, target)
        self.block_size = engine_config.block_size
        # Scratch: each sequence of a batch may write k - 1 positions past its last allocated block.
        self.scratch_per_seq = -(-(config.num_speculative_tokens - 1) // self.block_size)
        self.first_scratch = num_blocks
        total = num_blocks + self.scratch_per_seq * engine_config.max_num_seqs
        # The draft runs in its own dtype (default: the target's), its KV unquantized and its steps eager.
        draft_engine = dataclasses.replace(engine_config, speculative_config=None, kv_cache_dtype="auto",
                                           dtype=config.dtype or engine_config.dtype,
                                           quantization=config.quantization, enforce_eager=True,
                                           max_model_len=max_model_len)
        kv_cache = torch.zeros((draft_config.num_layers, 2, total, self.block_size, draft_config.num_kv_heads,
                                draft_config.head_dim), dtype=kv_cache_torch_dtype(draft_engine),
                               device=torch.device(engine_config.device))
        self.runner = ModelRunner(draft_config, draft_engine, iter_safetensors(path), kv_cache=kv_cache)
        # A draft step streams the draft's weights as a target step streams the target's.
        self.relative_cost = model_bytes(self.runner.model) / max(target_bytes, 1)
        self._cached: dict[str, DraftCacheState] = {}

    @torch.inference_mode()
    def propose_many(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        active = [i for i, limit in enumerate(limits) if limit > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not active:
            return drafts
        views = {}
        for slot, i in enumerate(active):
            seq = seqs[i]
            state = self._cached.setdefault(seq.request_id, DraftCacheState())
            done = min(state.valid_prefix(seq, self.block_size), seq.num_tokens - 1)
            scratch = list(range(self.first_scratch + slot * self.scratch_per_seq,
                                 self.first_scratch + (slot + 1) * self.scratch_per_seq))
            views[i] = DraftView(list(seq.token_ids), list(seq.block_ids) + scratch, done)
        # Step 1: every sequence's uncomputed tokens (single-token chunks first, as StepInputs wants).
        order = sorted(active, key=lambda i: seqs[i].num_tokens - views[i].num_computed_tokens != 1)
        chunks = [ScheduledChunk(views[i], seqs[i].num_tokens - views[i].num_computed_tokens) for i in order]
        tokens = self._greedy(chunks)
        for i, token in zip(order, tokens):
            views[i].num_computed_tokens = seqs[i].num_tokens
            views[i].token_ids.append(token)
            drafts[i].append(token)
        # Steps 2..k: one token each, for the sequences that want more.
        for j in range(1, max(limits[i] for i in active)):
            running = [i for i in active if limits[i] > j]
            if not running:
                break
            tokens = self._greedy([ScheduledChunk(views[i], 1) for i in running])
            for i, token in zip(running, tokens):
                views[i].num_computed_tokens += 1
                views[i].token_ids.append(token)
                drafts[i].append(token)
        for i in active:
            seq, view = seqs[i], views[i]
            # KV was written for the view's computed tokens; only those in the sequence's own blocks stay.
            kept = min(view.num_computed_tokens, len(seq.block_ids) * self.block_size)
            self._cached[seq.request_id] = DraftCacheState(view.token_ids[:kept], list(seq.block_ids), seq.num_preemptions)
        return drafts

    def _greedy(self, chunks: list[ScheduledChunk]) -> list[int]:
        logits = self.runner.execute(chunks, [True] * len(chunks))
        return logits.argmax(dim=-1).tolist()

    def forget(self, seq: Sequence, finished: bool) -> None:
        self._cached.pop(seq.request_id, None)
