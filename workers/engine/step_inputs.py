"""One step's batch as plain lists (StepInputs): what the forward pass needs besides the weights
and the KV cache, and what rank 0 of a tensor-parallel group broadcasts to the other ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.lora import LoRAModuleSpec
from workers.engine.sequence import StepChunk


@dataclass(frozen=True)
class StepInputs:
    """One step's batch as plain lists: what the forward pass needs besides the weights and the
    KV cache, and what rank 0 of a tensor-parallel group broadcasts to the others. Decode rows
    (one token each) come first; slots are flat KV cache slots (block * block_size + offset)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    num_decode: int
    decode_rows: list[list[int]]  # block ids of each decode row
    decode_lens: list[int]  # context length of each decode row, its new token included
    prefill_rows: list[list[int]]
    prefill_lens: list[int]
    query_start: list[int]  # prefix sums of the prefill chunks' token counts, from 0
    logits_index: list[int]  # rows of the hidden states whose logits are wanted
    # [start, end) row ranges of tokens in their sequence's prompt (merged where they touch): a
    # CPU layer stack may project them at float32_prompt_matmul's precision (workers/engine/cpu_layer_stack.py)
    prompt_runs: list[tuple[int, int]]
    # LoRA (workers/lora): each row's adapter slot (-1: the base model; None: no adapter this step),
    # and the adapter in each slot, which the other ranks of a tensor-parallel group adopt.
    lora_rows: list[int] | None = None
    lora_slots: tuple[LoRAModuleSpec | None, ...] = ()

    @classmethod
    def of(cls, chunks: Sequence[StepChunk], sample_mask: list[bool], block_size: int) -> StepInputs:
        bs = block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_rows: list[list[int]] = []
        prefill_lens: list[int] = []
        query_start = [0]
        logits_index: list[int] = []
        prompt_runs: list[tuple[int, int]] = []
        num_decode = 0
        for chunk, sample in zip(chunks, sample_mask):
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            prompt_rows = max(0, min(end, seq.num_prompt_tokens) - start)
            if prompt_rows:
                row = len(input_ids)
                if prompt_runs and prompt_runs[-1][1] == row:
                    prompt_runs[-1] = (prompt_runs[-1][0], row + prompt_rows)
                else:
                    prompt_runs.append((row, row + prompt_rows))
            input_ids.extend(chunk.input_token_ids if chunk.draft_token_ids else seq.token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = seq.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1 and not prefill_rows:
                num_decode += 1
                decode_rows.append(block_ids)
                decode_lens.append(end)
            else:
                assert n >= 1
                prefill_rows.append(block_ids)
                prefill_lens.append(end)
                query_start.append(query_start[-1] + n)
            if sample:
                # A draft chunk's rows verify its drafts: its last token's and each draft's.
                logits_index.extend(range(len(input_ids) - 1 - len(chunk.draft_token_ids), len(input_ids)))
        return cls(
            input_ids,
            positions,
            slots,
            num_decode,
            decode_rows,
            decode_lens,
            prefill_rows,
            prefill_lens,
            query_start,
            logits_index,
            prompt_runs,
        )
