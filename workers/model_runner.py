"""Loads the model and its paged KV cache, turns a scheduled batch into tensors, runs the forward pass.

KV cache layout: one tensor kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
kv_cache[l, 0] holds layer l's keys, kv_cache[l, 1] its values. Token position p of a sequence
lives in block block_ids[p // block_size] at offset p % block_size, i.e. slot
block_ids[p // block_size] * block_size + p % block_size. One tensor for all layers lets the KV
transfer move a sequence's blocks in one gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import ops
from workers.config import EngineConfig
from workers.model_config import ModelConfig
from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM
from workers.sequence import Sequence

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ScheduledChunk:
    """num_tokens new tokens of seq to compute this step, starting at seq.num_computed_tokens."""

    seq: Sequence
    num_tokens: int


def iter_safetensors(model_dir: Path):
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, weights, kv_cache: torch.Tensor | None = None):
        self.model_config = model_config
        self.config = engine_config
        self.device = torch.device(engine_config.device)
        self.dtype = TORCH_DTYPES[engine_config.dtype]
        self.block_size = engine_config.block_size
        self.max_model_len = engine_config.max_model_len or model_config.max_position_embeddings
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config)
        model = model.to_empty(device=self.device).to(self.dtype)
        # The rope table stays float32 whatever the model dtype: positions need the precision.
        model.cos_sin_cache = ops.build_rope_cache(
            model_config.head_dim, self.max_model_len, model_config.rope_theta, model_config.rope_scaling
        ).to(self.device)
        with torch.no_grad():
            model.load_hf_weights(weights)
        self.model = model.eval()

        self.kv_dtype = self.dtype if engine_config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if kv_cache is None:
            num_blocks = engine_config.num_kv_blocks or engine_config.kv_cache_memory // kv_block_bytes(
                model_config, self.block_size, self.kv_dtype
            )
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory {engine_config.kv_cache_memory} bytes holds no KV block")
            kv_cache = torch.zeros(
                (model_config.num_layers, 2, num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim),
                dtype=self.kv_dtype, device=self.device,
            )
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[2]
        self.k_scales = [1.0] * model_config.num_layers
        self.v_scales = [1.0] * model_config.num_layers

    def kv_views(self) -> list[KVCacheView]:
        return [
            KVCacheView(self.kv_cache[l, 0], self.kv_cache[l, 1], self.k_scales[l], self.v_scales[l])
            for l in range(self.model_config.num_layers)
        ]

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(len(rows), width)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], sample_mask: list[bool]) -> torch.Tensor:
        """Run one step. chunks must list single-token (decode) chunks first.

        Returns float32 logits [number of True in sample_mask, vocab] for the last token of each
        chunk whose sample_mask entry is True, in chunk order.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, decode_lens = [], []
        prefill_rows, prefill_lens, query_start = [], [], [0]
        logits_index: list[int] = []
        num_decode = 0
        for chunk, sample in zip(chunks, sample_mask):
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
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
                logits_index.append(len(input_ids) - 1)

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=num_decode,
            decode_block_tables=self._block_table(decode_rows).to(device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            prefill_block_tables=self._block_table(prefill_rows).to(device),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            self.kv_views(),
        )
        return self.model.compute_logits(hidden[logits_index])
