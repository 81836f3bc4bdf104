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

Each draft is one token (a point mass), so verification is the engine's rejection rule for a
point-mass proposal (workers/speculative/speculator.py) and the output distribution is unchanged whatever the
drafts are. Which token: for a greedy request, the draft's argmax. For a sampled request, the token
the plain sampler would draw from the draft's distribution (the request's temperature, top-k, top-p,
min-p and penalties) with the key the verification will draw that position's token with: the
request's generator drawn ahead on a copy (the engine gives every sampled request a generator of its
own when it drafts so). The verification's token at a position is the target's race with that key,
the draft's the draft's race with the same key, so they agree whenever the two distributions put the
race's winner on the same token: a draft close to the target is accepted about as often as under
greedy decoding, where its argmax would be accepted only with the target's probability of that one
token (often low at temperature 1).

Disaggregated: a prefill worker's draft runs over each prefill chunk of a peer's request beside the
target (`prefill_kv`), so the prompt's draft KV sits in the same blocks as the target's and travels
in the same handoff (kvtransfer.resharding); the decode worker then takes the prompt's draft KV as
computed (`adopt_prompt`) and its first proposal runs only the first token through the draft. A
prefill worker's every block is written so, so its prefix-cache hits hold the draft's KV too. A
decode worker's hits (blocks not sent) are trusted only where the draft is known to have filled the
block whole for the same tokens: the proposer keeps, per block id, the chained hash of the tokens
it last filled it with (forgotten when it writes the block again), and compares it with the hit's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.block_hash import hash_prefix_blocks, root_hash
from common.protocol import KVLayout
from common.sampling_params import SamplingParams
from kvtransfer.base import dtype_name
from workers.config import EngineConfig, SpeculativeConfig
from workers.engine.kv_cache import kv_cache_torch_dtype
from workers.engine.loader import model_bytes
from workers.engine.model_runner import ModelRunner
from workers.engine.sampler import SamplingRow, sample
from workers.engine.sequence import ScheduledChunk, Sequence, StepChunk
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig


@dataclass
class DraftView:
    """A sequence as the draft's ModelRunner reads it (the attributes StepInputs.of uses)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int  # as the target's: prompt rows run at float32_prompt_matmul's precision in both
    adapter: str | None = None  # the draft model serves no LoRA adapter


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
        while (
            blocks < len(self.block_ids)
            and blocks < len(seq.block_ids)
            and self.block_ids[blocks] == seq.block_ids[blocks]
        ):
            blocks += 1
        return min(n, blocks * block_size)


# A first pass of at most this many tokens per sequence (the last token and what the last verification
# accepted) costs about what a pass of one does: a proposal that had only such passes is all drafting.
CATCH_UP_TOKENS = 5

# Where a draft model's KV cache lives: (its layout, number of blocks) -> the cache tensor.
AllocateKV = Callable[[KVLayout, int], torch.Tensor]


def chained_hashes(seq: Sequence, start: int, stop: int, block_size: int) -> list[int]:
    """The chained hashes of seq's blocks start..stop-1 (full ones): the block manager's
    (Sequence.block_hashes), extended where it has not hashed them yet."""
    known = seq.block_hashes
    if len(known) >= stop:
        return known[start:stop]
    parent = known[-1] if known else root_hash(seq.kv_namespace)
    more = hash_prefix_blocks(seq.token_ids[len(known) * block_size : stop * block_size], block_size, parent)
    return known[start:] + more if start <= len(known) else more[start - len(known) :]


def keys_ahead(seq: Sequence, generator: torch.Generator | None) -> tuple[SamplingParams, torch.Generator] | None:
    """For a sampled sequence with a generator: its sampling parameters (without logprobs, which a
    draft does not report) and a copy of the generator, whose draws are then the keys the
    verification will use, position by position; None for a greedy one or without a generator."""
    params = seq.sampling_params
    if generator is None or params.greedy:
        return None
    ahead = torch.Generator(device=generator.device)
    ahead.set_state(generator.get_state())
    return dataclasses.replace(params, logprobs=None), ahead


def load_draft(config: SpeculativeConfig, target: ModelConfig) -> tuple[ModelConfig, Path]:
    """The draft's model config, checked against the target's (same vocabulary); ValueError naming `model`."""
    if config.model is None:
        raise ValueError("speculative_config.model must name the draft model's folder for method 'draft_model'")
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config.model {config.model!r} is not a model folder (no config.json)")
    draft = ModelConfig.from_model_dir(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft.vocab_size} tokens, the served model "
            f"{target.vocab_size}: the draft must share the target's tokenizer"
        )
    return draft, path


class DraftModelProposer:
    """Drafts from a smaller model: its argmax, or drawn with the verification's keys (see the module docstring)."""

    draws_with_keys = True

    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        engine_config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        target_bytes: int,
        allocate_kv: AllocateKV | None = None,
    ) -> None:
        """`allocate_kv(layout, num_blocks)`: where the draft's cache lives (a worker's KV transport,
        so that handoffs carry it); None: a tensor of its own."""
        draft_config, path = load_draft(config, target)
        self.block_size = engine_config.block_size
        # Scratch: each sequence of a batch may write k - 1 positions past its last allocated block.
        self.scratch_per_seq = -(-(config.num_speculative_tokens - 1) // self.block_size)
        self.first_scratch = num_blocks
        total = num_blocks + self.scratch_per_seq * engine_config.max_num_seqs
        # The draft runs in its own dtype (default: the target's), its KV unquantized and its steps eager.
        draft_engine = dataclasses.replace(
            engine_config,
            speculative_config=None,
            kv_cache_dtype="auto",
            dtype=config.dtype or engine_config.dtype,
            quantization=config.quantization,
            enforce_eager=True,
            max_model_len=max_model_len,
            # The draft proposes under the base model; the target verifies under the request's adapter.
            enable_lora=False,
            lora_modules=None,
        )
        kv_dtype = kv_cache_torch_dtype(draft_engine)
        self.layout = KVLayout(
            num_layers=draft_config.num_layers,
            num_kv_heads=draft_config.num_kv_heads,
            head_dim=draft_config.head_dim,
            block_size=self.block_size,
            dtype=dtype_name(kv_dtype),
            layer_windows=draft_config.layer_windows,
        )
        kv_cache = (
            allocate_kv(self.layout, total)
            if allocate_kv is not None
            else torch.zeros(self.layout.cache_shape(total), dtype=kv_dtype, device=torch.device(engine_config.device))
        )
        self.runner = ModelRunner(draft_config, draft_engine, iter_safetensors(path), kv_cache=kv_cache)
        # A draft step streams the draft's weights as a target step streams the target's.
        self.relative_cost = model_bytes(self.runner.model) / max(target_bytes, 1)
        self._cached: dict[str, DraftCacheState] = {}
        self.num_computed_tokens = 0  # tokens run through the draft since start (prompts and drafts)
        self._passes: list[tuple[float, int]] = []
        # Block id -> chained hash of the block's tokens, where the draft's KV fills it whole for them.
        self._filled: dict[int, int] = {}

    @torch.inference_mode()
    def prefill_kv(self, chunks: list[tuple[ScheduledChunk, bool]]) -> None:
        """Write the draft's KV of prompt chunks of the target's step in the same blocks; call it
        before their sequences' computed tokens advance. A peer's chunk (True) always: it travels in
        the handoff. A chunk of this worker's own request only where the draft has KV for all before
        it (an earlier chunk, or a prefix-cache hit in blocks it filled): the first proposal then
        runs a token instead of the prompt, and a prompt it has no start of is left to that proposal."""
        run = [c for c, for_peer in chunks if for_peer or self._extends(c)]
        if not run:
            return
        ran = {id(c) for c in run}
        views = [
            StepChunk(
                DraftView(c.seq.token_ids, c.seq.block_ids, c.seq.num_computed_tokens, c.seq.num_prompt_tokens),
                c.num_tokens,
            )
            for c in sorted(run, key=lambda c: c.num_tokens != 1)
        ]  # single-token chunks first
        self.runner.execute(views, [False] * len(views))
        self.num_computed_tokens += sum(c.num_tokens for c in run)
        for c, for_peer in chunks:
            if not for_peer and id(c) in ran:
                seq, end = c.seq, c.seq.num_computed_tokens + c.num_tokens
                self._cached[seq.request_id] = DraftCacheState(
                    seq.token_ids[:end], list(seq.block_ids), seq.num_preemptions
                )
                self._refill(seq, seq.num_computed_tokens, end)

    def _extends(self, chunk: ScheduledChunk) -> bool:
        """Whether the draft has KV for all of chunk's sequence before the chunk (see prefill_kv)."""
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        state = self._cached.get(seq.request_id)
        if state is not None:
            return state.valid_prefix(seq, self.block_size) >= start
        return start > 0 and start % self.block_size == 0 and self._holds(seq, start // self.block_size)

    def _holds(self, seq: Sequence, num_blocks: int) -> bool:
        """Whether the draft filled each of seq's first num_blocks blocks whole for seq's tokens."""
        hashes = chained_hashes(seq, 0, num_blocks, self.block_size)
        return all(self._filled.get(block_id) == h for block_id, h in zip(seq.block_ids, hashes))

    def _refill(self, seq: Sequence, start: int, end: int) -> None:
        """The draft wrote seq's positions start..end-1 for seq's tokens: the blocks from start's on
        are forgotten, and those it now fills whole remembered."""
        first, whole = start // self.block_size, end // self.block_size
        self._forget_filled(seq.block_ids[first:])
        if whole > first:
            self._filled.update(zip(seq.block_ids[first:whole], chained_hashes(seq, first, whole, self.block_size)))

    def adopt_prompt(self, seq: Sequence, num_cached_tokens: int) -> bool:
        """seq's prompt KV arrived from a prefill worker with the draft's (prefill_kv there), except its
        first num_cached_tokens, found in this worker's prefix cache. If the draft filled those blocks
        for the same tokens, it has KV for the whole prompt and catches up from its end (True);
        otherwise it runs the prompt again at its first proposal."""
        if not self._holds(seq, num_cached_tokens // self.block_size):
            self._forget_filled(seq.block_ids[num_cached_tokens // self.block_size :])  # the transfer wrote them
            return False
        self._cached[seq.request_id] = DraftCacheState(
            list(seq.prompt_token_ids), list(seq.block_ids), seq.num_preemptions
        )
        self._refill(seq, num_cached_tokens, seq.num_prompt_tokens)
        return True

    def _forget_filled(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._filled.pop(block_id, None)

    @torch.inference_mode()
    def propose_many(
        self, seqs: list[Sequence], limits: list[int], generators: list[torch.Generator | None] | None = None
    ) -> list[list[int]]:
        active = [i for i, limit in enumerate(limits) if limit > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not active:
            return drafts
        keys = {i: keys_ahead(seqs[i], generators[i]) for i in active if generators is not None}

        def rows(order: list[int]) -> list[SamplingRow | None]:
            """The sampler's row of each sequence's next draft (None: the draft's argmax)."""
            return [
                None
                if (key := keys.get(i)) is None
                else SamplingRow(key[0], seqs[i].output_token_ids + drafts[i], seqs[i].prompt_token_ids, key[1])
                for i in order
            ]

        views, done_before = {}, {}
        for slot, i in enumerate(active):
            seq = seqs[i]
            state = self._cached.setdefault(seq.request_id, DraftCacheState())
            done = min(state.valid_prefix(seq, self.block_size), seq.num_tokens - 1)
            scratch = list(
                range(
                    self.first_scratch + slot * self.scratch_per_seq,
                    self.first_scratch + (slot + 1) * self.scratch_per_seq,
                )
            )
            views[i] = DraftView(list(seq.token_ids), list(seq.block_ids) + scratch, done, seq.num_prompt_tokens)
            done_before[i] = done
        # Step 1: every sequence's uncomputed tokens (single-token chunks first, as StepInputs wants).
        order = sorted(active, key=lambda i: seqs[i].num_tokens - views[i].num_computed_tokens != 1)
        chunks = [StepChunk(views[i], seqs[i].num_tokens - views[i].num_computed_tokens) for i in order]
        self._passes = []  # (seconds, most tokens of a sequence) of each pass: drafting_seconds
        tokens = self._next_tokens(chunks, rows(order))
        for i, token in zip(order, tokens):
            views[i].num_computed_tokens = seqs[i].num_tokens
            views[i].token_ids.append(token)
            drafts[i].append(token)
        # Steps 2..k: one token each, for the sequences that want more.
        for j in range(1, max(limits[i] for i in active)):
            running = [i for i in active if limits[i] > j]
            if not running:
                break
            tokens = self._next_tokens([StepChunk(views[i], 1) for i in running], rows(running))
            for i, token in zip(running, tokens):
                views[i].num_computed_tokens += 1
                views[i].token_ids.append(token)
                drafts[i].append(token)
        for i in active:
            seq, view = seqs[i], views[i]
            # KV was written for the view's computed tokens; only those in the sequence's own blocks stay.
            kept = min(view.num_computed_tokens, len(seq.block_ids) * self.block_size)
            self._cached[seq.request_id] = DraftCacheState(
                view.token_ids[:kept], list(seq.block_ids), seq.num_preemptions
            )
            # Written from `done` on: for the sequence's tokens up to its last, and past it for drafts.
            self._refill(seq, done_before[i], seq.num_tokens)
        return drafts

    def _next_tokens(self, chunks: list[StepChunk], rows: list[SamplingRow | None]) -> list[int]:
        """The draft's next token after each chunk: drawn as `rows` say (see propose_many), else its argmax."""
        started = time.perf_counter()
        logits = self.runner.execute(chunks, [True] * len(chunks))
        self.num_computed_tokens += sum(c.num_tokens for c in chunks)
        tokens = logits.argmax(dim=-1).tolist()
        keyed = [i for i, row in enumerate(rows) if row is not None]
        if keyed:
            keyed_rows = [row for row in rows if row is not None]  # in the order of `keyed`
            drawn, _ = sample(logits[keyed], keyed_rows, race=self.runner.ops.exponential_race)
            for i, token in zip(keyed, drawn):
                tokens[i] = token
        self._passes.append((time.perf_counter() - started, max(c.num_tokens for c in chunks)))
        return tokens

    def drafting_seconds(self, measured: float) -> float | None:
        """The last proposal's passes as if each ran one token per sequence: a draft costs a pass, but
        a first pass that caught up on many tokens (a prompt the draft had not run) costs more, once."""
        single = [seconds for seconds, most in self._passes if most == 1]
        if single:
            return sum(single) / len(single) * len(self._passes)
        return measured if all(most <= CATCH_UP_TOKENS for _, most in self._passes) else None

    def forget(self, seq: Sequence, finished: bool) -> None:
        if self._cached.pop(seq.request_id, None) is None:
            # It left before the draft ran for it or took its prompt's KV (e.g. a failed KV transfer):
            # what a transfer may have written into its blocks is not known.
            self._forget_filled(seq.block_ids[seq.num_cached_tokens // self.block_size :])
