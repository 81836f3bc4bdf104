"""Loads the model and its paged KV cache, turns a scheduled batch into tensors, runs the forward pass.

KV cache layout: one tensor kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
kv_cache[l, 0] holds layer l's keys, kv_cache[l, 1] its values. Token position p of a sequence
lives in block block_ids[p // block_size] at offset p % block_size, i.e. slot
block_ids[p // block_size] * block_size + p % block_size. One tensor for all layers lets the KV
transfer move a sequence's blocks in one gather.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.ops import kernel_ops
from kernels.plan import DeviceSpec
from kernels.rotary import build_rope_cache
from workers import packed_linear
from workers import quantization as q8
from workers.config import CPU_KV_CACHE_MEMORY, EngineConfig
from workers.cpu_layer_stack import cpu_layer_stack, stack_hidden
from workers.cuda_graphs import DecodeGraphs, GraphBuckets, cuda_graph_factory, decode_graphs_wanted, graph_batch_sizes
from workers.device import GIB, check_fp8_config, gpu_kv_cache_blocks, gpu_total_memory
from workers.kv_calibration import calibrate_kv_scales, calibration_token_ids
from workers.model_config import ModelConfig
from workers.models.gemma import GemmaForCausalLM
from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM
from workers.models.moe import MoeForCausalLM
from workers.sequence import ScheduledChunk

# The model class of each supported architecture (workers.model_files.SUPPORTED_ARCHITECTURES).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"),
        LlamaForCausalLM,
    ),
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

log = logging.getLogger(__name__)


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


def allocate_empty(model: torch.nn.Module, device) -> torch.nn.Module:
    """`model` (built on the meta device) with uninitialised storage on `device` for every parameter
    and buffer, as `Module.to_empty` gives. to_empty reaches `torch.empty_like` through PyTorch's
    reference ops, whose first call imports sympy: about 0.8 s of every worker's start on a CPU."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            setattr(
                module,
                name,
                torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad),
            )
        for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
    return model


def load_model(
    model_config: ModelConfig, engine_config: EngineConfig, weights, max_model_len: int | None = None, tp_group=None
) -> LlamaForCausalLM:
    """Build the model on the kernels engine_config.kernel_backend picks, and load `weights` into it,
    quantizing to FP8 as the config or checkpoint says. With tp_group (workers.tensor_parallel),
    model_config and weights are this rank's shard.

    Pre-quantized checkpoints load their FP8 tensors as they are; a float checkpoint with
    engine_config.quantization == "fp8" is loaded in float, then each linear layer is quantized.
    On the CPU, plain linear layers are prepacked for oneDNN when engine_config.packed_linear is set.
    """
    device = torch.device(engine_config.device)
    dtype = TORCH_DTYPES[engine_config.dtype]
    checkpoint_quant = q8.parse_quantization_config(getattr(weights, "quantization_config", None))
    # Before any kernel runs: FP8 on a GPU without native FP8 fails to compile at its first launch.
    check_fp8_config(
        DeviceSpec.of(device),
        engine_config.quantization,
        engine_config.kv_cache_dtype,
        fp8_checkpoint=checkpoint_quant is not None,
    )
    model_class = MODEL_CLASSES.get(model_config.architecture)
    if model_class is None:
        raise ValueError(
            f"no model class for architecture {model_config.architecture!r}; known: {', '.join(MODEL_CLASSES)}"
        )
    ops = kernel_ops(engine_config.kernel_backend, device)
    if tp_group is not None and model_class not in (LlamaForCausalLM, MoeForCausalLM):
        raise ValueError(
            f"{model_config.architecture}: tensor parallelism supports the Llama family and "
            f"mixture-of-experts models only so far"
        )
    with torch.device("meta"):
        model = model_class(model_config, ops) if tp_group is None else model_class(model_config, ops, tp_group)
    if checkpoint_quant is not None:
        q8.prepare_for_checkpoint(model, checkpoint_quant, ops)
    model = q8.cast_model(allocate_empty(model, device), dtype)
    # The rope table stays float32 whatever the model dtype: positions need the precision.
    model.cos_sin_cache = build_rope_cache(
        model_config.head_dim,
        max_model_len or model_config.max_position_embeddings,
        model_config.rope_theta,
        model_config.rope_scaling,
    ).to(device)
    if model_config.local_rope_theta is not None:  # Gemma 3's sliding layers: their own rope base
        model.local_cos_sin_cache = build_rope_cache(
            model_config.head_dim,
            max_model_len or model_config.max_position_embeddings,
            model_config.local_rope_theta,
            model_config.local_rope_scaling,
        ).to(device)
    with torch.no_grad():
        model.load_hf_weights(weights, checkpoint_quant)
        if checkpoint_quant is None and engine_config.quantization == "fp8":
            q8.quantize_linears(model, ops)
        if device.type == "cpu" and engine_config.packed_linear:
            packed_linear.prepack(model)
    return model.eval()


def kv_cache_scales(
    model: LlamaForCausalLM, engine_config: EngineConfig, weights=None
) -> tuple[tuple[float, float], ...]:
    """Per-layer (k_scale, v_scale): given in the config, calibrated for an FP8 cache, else all 1.0."""
    num_layers = model.config.num_layers
    if engine_config.kv_cache_dtype != "fp8":
        return ((1.0, 1.0),) * num_layers
    if engine_config.kv_scales is not None:
        if len(engine_config.kv_scales) != num_layers:
            raise ValueError(
                f"kv_scales has {len(engine_config.kv_scales)} (k, v) pairs; the model has {num_layers} layers"
            )
        return tuple((float(k), float(v)) for k, v in engine_config.kv_scales)
    tokens = calibration_token_ids(getattr(weights, "model_dir", None), model.config.vocab_size)
    return calibrate_kv_scales(model, tokens, TORCH_DTYPES[engine_config.dtype], engine_config.block_size)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def kv_cache_torch_dtype(engine_config: EngineConfig) -> torch.dtype:
    return TORCH_DTYPES[engine_config.dtype] if engine_config.kv_cache_dtype == "auto" else torch.float8_e4m3fn


def num_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig) -> int:
    """Blocks the KV cache gets without profiling: num_kv_blocks if set, else as many as
    kv_cache_memory holds (unset: CPU_KV_CACHE_MEMORY, the CPU's default). A GPU worker without
    either sizes its cache with kv_cache_num_blocks instead."""
    memory = engine_config.kv_cache_memory or CPU_KV_CACHE_MEMORY
    num_blocks = engine_config.num_kv_blocks or memory // kv_block_bytes(
        model_config, engine_config.block_size, kv_cache_torch_dtype(engine_config)
    )
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes holds no KV block")
    return num_blocks


def sizes_kv_cache_from_gpu_memory(engine_config: EngineConfig) -> bool:
    """Whether the KV cache takes what --gpu-memory-utilization leaves (a CUDA device, and
    neither num_kv_blocks nor kv_cache_memory given)."""
    return (
        torch.device(engine_config.device).type == "cuda"
        and engine_config.num_kv_blocks is None
        and engine_config.kv_cache_memory is None
    )


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (weights, scales, the rope table)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    extra = [t for t in vars(model).values() if isinstance(t, torch.Tensor)]  # e.g. cos_sin_cache
    tensors.update({id(t): t for t in extra})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def profile_activation_peak(model: LlamaForCausalLM, engine_config: EngineConfig, max_model_len: int) -> int:
    """Peak CUDA memory, in bytes, of the largest step the engine runs: a prefill chunk of
    max_num_batched_tokens tokens, then logits for max_num_seqs rows (vLLM's profile run)."""
    cfg, device, bs = model.config, model.embed_tokens.weight.device, engine_config.block_size
    n = max(1, min(engine_config.max_num_batched_tokens, max_model_len))
    num_blocks = -(-n // bs)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = torch.zeros(
        (cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim),
        dtype=kv_cache_torch_dtype(engine_config),
        device=device,
    )
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 0), **i32),
        decode_context_lens=torch.zeros((0,), **i32),
        prefill_block_tables=torch.arange(num_blocks, **i32).reshape(1, num_blocks),
        prefill_query_start_loc=torch.tensor([0, n], **i32),
        prefill_context_lens=torch.tensor([n], **i32),
    )
    views = [KVCacheView(cache[layer, 0], cache[layer, 1]) for layer in range(cfg.num_layers)]
    hidden = model(torch.zeros(n, dtype=torch.int64, device=device), torch.arange(n, device=device), meta, views)
    rows = min(n, engine_config.max_num_seqs)
    logits = model.compute_logits(hidden[-rows:])
    torch.log_softmax(logits, dim=-1)  # the sampler's and logprobs' working copy
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, logits, cache, views
    torch.cuda.empty_cache()
    return max(0, peak)


def kv_cache_num_blocks(
    model: LlamaForCausalLM, model_config: ModelConfig, engine_config: EngineConfig, max_model_len: int | None = None
) -> int:
    """Blocks the KV cache gets, once the model is loaded: on a GPU without --kv-cache-memory,
    --gpu-memory-utilization of the device less the weights and the profiled activation peak
    (workers.device.gpu_kv_cache_blocks); else num_kv_blocks(). Logs the result."""
    block_bytes = kv_block_bytes(model_config, engine_config.block_size, kv_cache_torch_dtype(engine_config))
    if not sizes_kv_cache_from_gpu_memory(engine_config):
        blocks = num_kv_blocks(model_config, engine_config)
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB)",
            blocks,
            engine_config.block_size,
            blocks * engine_config.block_size,
            blocks * block_bytes / GIB,
        )
        return blocks
    name = DeviceSpec.of(engine_config.device).name
    total = gpu_total_memory(engine_config.device)
    weights = model_bytes(model)
    activations = profile_activation_peak(model, engine_config, max_model_len or model_config.max_position_embeddings)
    blocks = gpu_kv_cache_blocks(total, engine_config.gpu_memory_utilization, weights, activations, block_bytes)
    free, _ = torch.cuda.mem_get_info(torch.device(engine_config.device))
    if blocks * block_bytes > free:
        log.warning(
            "the KV cache wants %.2f GiB but %s has %.2f GiB free (another process holds memory?): "
            "lower --gpu-memory-utilization or give --kv-cache-memory",
            blocks * block_bytes / GIB,
            name,
            free / GIB,
        )
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB): --gpu-memory-utilization %s of %s's "
        "%.2f GiB, less %.2f GiB of weights and a %.2f GiB activation peak",
        blocks,
        engine_config.block_size,
        blocks * engine_config.block_size,
        blocks * block_bytes / GIB,
        engine_config.gpu_memory_utilization,
        name,
        total / GIB,
        weights / GIB,
        activations / GIB,
    )
    return blocks


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        weights,
        kv_cache: torch.Tensor | None = None,
        tp_group=None,
    ):
        self.model_config = model_config
        # A tensor-parallel group of more than one rank (workers.tensor_parallel.TPGroup): rank 0
        # broadcasts each step's inputs before running it, the other ranks run them in follow().
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
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
                raise ValueError(
                    "a prebuilt model with an FP8 KV cache needs EngineConfig.kv_scales "
                    "(from model_runner.kv_cache_scales on the checkpoint)"
                )
            if self.model.cos_sin_cache.shape[0] < self.max_model_len:
                raise ValueError(
                    f"prebuilt model's rope table covers {self.model.cos_sin_cache.shape[0]} positions, "
                    f"max_model_len is {self.max_model_len}"
                )
        else:
            self.model = load_model(model_config, engine_config, weights, self.max_model_len)
        self.ops = self.model.ops  # the kernels the model was built on

        self.kv_dtype = kv_cache_torch_dtype(engine_config)
        if kv_cache is None:
            kv_cache = torch.zeros(
                (
                    model_config.num_layers,
                    2,
                    kv_cache_num_blocks(self.model, model_config, engine_config, self.max_model_len),
                    self.block_size,
                    model_config.num_kv_heads,
                    model_config.head_dim,
                ),
                dtype=self.kv_dtype,
                device=self.device,
            )
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[2]
        self.kv_scales = kv_cache_scales(self.model, engine_config, weights)
        self.k_scales = [k for k, _ in self.kv_scales]
        self.v_scales = [v for _, v in self.kv_scales]
        # Decode steps replay CUDA graphs (workers/cuda_graphs.py), captured now that the KV cache
        # and its scales exist; None (the CPU, --enforce-eager) runs every step eagerly. The graphs
        # hold the cache's address: it is written in place (KV handoff included), never replaced.
        self.decode_graphs: DecodeGraphs | None = None
        # Not with tensor parallelism yet: a replayed graph would skip the step's broadcast.
        if self.tp_group is None and decode_graphs_wanted(engine_config.enforce_eager, self.device, self.ops.backend):
            self.capture_decode_graphs(cuda_graph_factory())
        # On the CPU, steps run the decoder layers in one native call where the model allows
        # (workers/cpu_layer_stack.py); it holds the cache's and the packed weights' addresses.
        self.layer_stack = (
            None
            if engine_config.enforce_eager
            else cpu_layer_stack(self.model, kv_cache, self.tp_group, engine_config.float32_prompt_matmul)
        )

    def capture_decode_graphs(self, new_graph, batch_sizes=None) -> DecodeGraphs:
        """Capture the decode forward once per batch-size bucket (default: graph_batch_sizes of
        max_num_seqs) with graphs from new_graph(); later decode-only steps that fit replay them.
        The CPU tests call it with a stand-in graph."""
        started = time.perf_counter()
        buckets = GraphBuckets(batch_sizes or graph_batch_sizes(self.config.max_num_seqs))
        # No row is wider than the longest sequence the cache can hold.
        max_len = min(self.max_model_len, self.num_blocks * self.block_size)
        graphs = DecodeGraphs(
            buckets,
            self._decode_forward,
            max_blocks_per_seq=-(-max_len // self.block_size),
            hidden_size=self.model_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
            new_graph=new_graph,
        )
        memory = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        with torch.inference_mode():
            graphs.capture()
        memory = (torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0) - memory
        log.info(
            "decode graphs captured for batch sizes %s in %.1f s (%.0f MiB)",
            ",".join(map(str, buckets)),
            time.perf_counter() - started,
            memory / (1 << 20),
        )
        self.decode_graphs = graphs
        return graphs

    def _decode_forward(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> torch.Tensor:
        """The forward pass of a decode-only batch (one token per sequence) on the given tensors:
        the function DecodeGraphs captures."""
        device = input_ids.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=input_ids.shape[0],
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefill_block_tables=torch.zeros((0, 0), dtype=torch.int32, device=device),
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        )
        return self.model(input_ids, positions, meta, self.kv_views())

    def kv_views(self) -> list[KVCacheView]:
        return [
            KVCacheView(self.kv_cache[layer, 0], self.kv_cache[layer, 1], self.k_scales[layer], self.v_scales[layer])
            for layer in range(self.model_config.num_layers)
        ]

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(len(rows), width)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], sample_mask: list[bool]) -> torch.Tensor:
        """Run one step. chunks must list single-token (decode) chunks first.

        Returns float32 logits, in chunk order, for the last token of each chunk whose sample_mask
        entry is True; a chunk with drafts (speculative decoding) gets a row for each of its last
        1 + len(draft_token_ids) positions. [rows, vocab]
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
        step = StepInputs.of(chunks, sample_mask, self.block_size)
        graphs = self.decode_graphs
        if graphs is not None and step.num_decode == len(step.input_ids) and graphs.fits(step.decode_rows):
            # Decode only: replay the bucket's graph; the rows past num_decode are padding, not returned.
            return graphs.run(
                step.input_ids, step.positions, step.slots, step.decode_rows, step.decode_lens
            ), step.logits_index
        if self.tp_group is not None:
            self.tp_group.broadcast_step(step)  # the other ranks run the same step on their shards
        return self.forward(step), step.logits_index

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The model over one step's inputs: hidden states [tokens, hidden]. Every rank of a
        tensor-parallel group runs it on the same inputs (its all-reduces join them)."""
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=device),
            num_decode_tokens=step.num_decode,
            decode_block_tables=self._block_table(step.decode_rows).to(device),
            decode_context_lens=torch.tensor(step.decode_lens, dtype=torch.int32, device=device),
            prefill_block_tables=self._block_table(step.prefill_rows).to(device),
            prefill_query_start_loc=torch.tensor(step.query_start, dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor(step.prefill_lens, dtype=torch.int32, device=device),
        )
        input_ids = torch.tensor(step.input_ids, dtype=torch.int64, device=device)
        positions = torch.tensor(step.positions, dtype=torch.int64, device=device)
        with torch.inference_mode():
            if self.layer_stack is not None and (self.layer_stack.takes_prefill or not step.prefill_rows):
                runs = torch.tensor(step.prompt_runs, dtype=torch.int64).reshape(-1, 2) if step.prompt_runs else None
                return stack_hidden(self.model, self.layer_stack, input_ids, positions, meta, runs)
            return self.model(input_ids, positions, meta, self.kv_views())

    def stop_followers(self) -> None:
        """Rank 0 of a tensor-parallel group: end the other ranks' follow() (no step comes after)."""
        if self.tp_group is not None:
            self.tp_group.broadcast_step(None)

    def follow(self) -> int:
        """A non-zero rank of a tensor-parallel group: run every step rank 0 broadcasts, until it
        broadcasts the end (StepInputs None). Returns the number of steps run."""
        assert self.tp_group is not None and self.tp_group.rank > 0
        steps = 0
        while (step := self.tp_group.receive_step()) is not None:
            self.forward(step)
            steps += 1
        return steps


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
    # CPU layer stack may project them at float32_prompt_matmul's precision (workers/cpu_layer_stack.py)
    prompt_runs: list[tuple[int, int]]

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], sample_mask: list[bool], block_size: int) -> StepInputs:
        bs = block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows, decode_lens = [], []
        prefill_rows, prefill_lens, query_start = [], [], [0]
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
