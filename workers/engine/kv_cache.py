"""The paged KV cache: its element type, the bytes of a block, and how many blocks it gets.

KV cache layout: one tensor kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
kv_cache[l, 0] holds layer l's keys, kv_cache[l, 1] its values. Token position p of a sequence
lives in block block_ids[p // block_size] at offset p % block_size, i.e. slot
block_ids[p // block_size] * block_size + p % block_size. One tensor for all layers lets the KV
transfer move a sequence's blocks in one gather.
"""

from __future__ import annotations

import logging

import torch

from kernels.plan import DeviceSpec
from workers.config import CPU_KV_CACHE_MEMORY, EngineConfig
from workers.engine.device import GIB, gpu_kv_cache_blocks, gpu_total_memory
from workers.engine.loader import TORCH_DTYPES, model_bytes
from workers.models.config import ModelConfig
from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM

log = logging.getLogger(__name__)


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
    meta = AttentionMetadata.one_prompt(n, num_blocks, device)
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
    (workers.engine.device.gpu_kv_cache_blocks); else num_kv_blocks(). Logs the result."""
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
