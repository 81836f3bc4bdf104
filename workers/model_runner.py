"""Loads the model and its paged KV cache, turns a scheduled batch into tensors, runs the forward pass.

KV cache layout: one tensor kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
kv_cache[l, 0] holds layer l's keys, kv_cache[l, 1] its values. Token position p of a sequence
lives in block block_ids[p // block_size] at offset p % block_size, i.e. slot
block_ids[p // block_size] * block_size + p % block_size. One tensor for all layers lets the KV
transfer move a sequence's blocks in one gather.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.ops import kernel_ops
from kernels.rotary import build_rope_cache
from workers import packed_linear
from workers import quantization as q8
from workers.config import EngineConfig
from workers.kv_calibration import calibrate_kv_scales, calibration_token_ids
from workers.model_config import ModelConfig
from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM
from workers.sequence import ScheduledChunk

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SafetensorsCheckpoint:
    """A model folder's weights as (name, tensor) pairs, plus what the loader needs besides them:
    the folder (its tokenizer calibrates FP8 KV scales) and config.json's quantization_config."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = sorted(self.model_dir.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"no *.safetensors files in {model_dir}")
        config_file = self.model_dir / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.quantization_config: dict | None = config.get("quantization_config")

    def __iter__(self):
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def iter_safetensors(model_dir: Path) -> SafetensorsCheckpoint:
    return SafetensorsCheckpoint(model_dir)


def load_model(model_config: ModelConfig, engine_config: EngineConfig, weights, max_model_len: int | None = None) -> LlamaForCausalLM:
    """Build the model on the kernels engine_config.kernel_backend picks, and load `weights` into it,
    quantizing to FP8 as the config or checkpoint says.

    Pre-quantized checkpoints load their FP8 tensors as they are; a float checkpoint with
    engine_config.quantization == "fp8" is loaded in float, then each linear layer is quantized.
    On the CPU, plain linear layers are prepacked for oneDNN when engine_config.packed_linear is set.
    """
    device = torch.device(engine_config.device)
    dtype = TORCH_DTYPES[engine_config.dtype]
    ops = kernel_ops(engine_config.kernel_backend, device)
    checkpoint_quant = q8.parse_quantization_config(getattr(weights, "quantization_config", None))
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config, ops)
    if checkpoint_quant is not None:
        q8.prepare_for_checkpoint(model, checkpoint_quant, ops)
    model = q8.cast_model(model.to_empty(device=device), dtype)
    # The rope table stays float32 whatever the model dtype: positions need the precision.
    model.cos_sin_cache = build_rope_cache(
        model_config.head_dim, max_model_len or model_config.max_position_embeddings,
        model_config.rope_theta, model_config.rope_scaling,
    ).to(device)
    with torch.no_grad():
        model.load_hf_weights(weights, checkpoint_quant)
        if checkpoint_quant is None and engine_config.quantization == "fp8":
            q8.quantize_linears(model, ops)
        if device.type == "cpu" and engine_config.packed_linear:
            packed_linear.prepack(model)
    return model.eval()


def kv_cache_scales(model: LlamaForCausalLM, engine_config: EngineConfig, weights=None) -> tuple[tuple[float, float], ...]:
    """Per-layer (k_scale, v_scale): given in the config, calibrated for an FP8 cache, else all 1.0."""
    num_layers = model.config.num_layers
    if engine_config.kv_cache_dtype != "fp8":
        return ((1.0, 1.0),) * num_layers
    if engine_config.kv_scales is not None:
        if len(engine_config.kv_scales) != num_layers:
            raise ValueError(f"kv_scales has {len(engine_config.kv_scales)} (k, v) pairs; the model has {num_layers} layers")
        return tuple((float(k), float(v)) for k, v in engine_config.kv_scales)
    tokens = calibration_token_ids(getattr(weights, "model_dir", None), model.config.vocab_size)
    return calibrate_kv_scales(model, tokens, TORCH_DTYPES[engine_config.dtype], engine_config.block_size)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def kv_cache_torch_dtype(engine_config: EngineConfig) -> torch.dtype:
    return TORCH_DTYPES[engine_config.dtype] if engine_config.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def num_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig) -> int:
    """Blocks the KV cache gets: num_kv_blocks if set, else as many as kv_cache_memory holds."""
    num_blocks = engine_config.num_kv_blocks or engine_config.kv_cache_memory // kv_block_bytes(
        model_config, engine_config.block_size, kv_cache_torch_dtype(engine_config)
    )
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {engine_config.kv_cache_memory} bytes holds no KV block")
    return num_blocks


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, weights, kv_cache: torch.Tensor | None = None):
        self.model_config = model_config
        self.config = engine_config
        self.device = torch.device(engine_config.device)
        self.dtype = TORCH_DTYPES[engine_config.dtype]
        self.block_size = engine_config.block_size
        self.max_model_len = engine_config.max_model_len or model_config.max_position_embeddings
        # `weights` may be a model load_model already built (workers need its KV scales before
        # their transport allocates the cache).
        if isinstance(weights, LlamaForCausalLM):
            self.model = weights
            if engine_config.kv_cache_dtype == "fp8" and engine_config.kv_scales is None:
                # Calibration tokenizes with the checkpoint's tokenizer, which a bare model lacks.
                raise ValueError("a prebuilt model with an FP8 KV cache needs EngineConfig.kv_scales "
                                 "(from model_runner.kv_cache_scales on the checkpoint)")
            if self.model.cos_sin_cache.shape[0] < self.max_model_len:
                raise ValueError(f"prebuilt model's rope table covers {self.model.cos_sin_cache.shape[0]} positions, "
                                 f"max_model_len is {self.max_model_len}")
        else:
            self.model = load_model(model_config, engine_config, weights, self.max_model_len)
        self.ops = self.model.ops  # the kernels the model was built on

        self.kv_dtype = kv_cache_torch_dtype(engine_config)
        if kv_cache is None:
            kv_cache = torch.zeros(
                (model_config.num_layers, 2, num_kv_blocks(model_config, engine_config), self.block_size,
                 model_config.num_kv_heads, model_config.head_dim),
                dtype=self.kv_dtype, device=self.device,
            )
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[2]
        self.kv_scales = kv_cache_scales(self.model, engine_config, weights)
        self.k_scales = [k for k, _ in self.kv_scales]
        self.v_scales = [v for _, v in self.kv_scales]

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
        hidden, logits_index = self._forward(chunks, sample_mask)
        return self.model.compute_logits(hidden[logits_index])

    @torch.inference_mode()
    def next_token_logprobs(self, chunk: ScheduledChunk, rows_per_slice: int = 256) -> torch.Tensor:
        """Run one prefill chunk; float32 log p(token[p + 1] | tokens[:p + 1]) for each of its
        positions p that has a next token in chunk.seq (the last position of the sequence has none).
        Logits are formed rows_per_slice at a time to bound memory ([rows, vocab] float32)."""
        hidden, _ = self._forward([chunk], [False])
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        targets = seq.token_ids[start + 1 : start + chunk.num_tokens + 1]
        out = []
        for i in range(0, len(targets), rows_per_slice):
            logits = self.model.compute_logits(hidden[i : i + rows_per_slice][: len(targets) - i])
            rows = torch.tensor(targets[i : i + rows_per_slice], device=logits.device)
            out.append(torch.log_softmax(logits, dim=-1).gather(1, rows[:, None])[:, 0])
        return torch.cat(out) if out else torch.zeros(0)

    def _forward(self, chunks: list[ScheduledChunk], sample_mask: list[bool]) -> tuple[torch.Tensor, list[int]]:
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
        return hidden, logits_index
