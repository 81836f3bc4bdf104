"""Builds an LLMEngine: its model runner (the model loaded beside its KV cache), its speculator (with
--speculative-config) and, from a model folder, its tokenizer's decode and grammar cache.

    engine = load_engine(None)                                   # the default model
    engine = load_engine("path/to/model", EngineConfig(...))
    engine = build_engine(model_config, engine_config, weights)  # from parts (a worker's shard)

The engine core (workers.engine) does not know workers.speculative; this module puts them together.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from common.detokenizer import Decode
from workers.config import EngineConfig
from workers.engine.grammar import GrammarCache
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner
from workers.lora.adapter import LoRASharding
from workers.models.checkpoint import iter_safetensors
from workers.models.config import ModelConfig
from workers.models.files import resolve_model_dir
from workers.speculative.draft_model import AllocateKV
from workers.speculative.speculator import Speculator


def build_engine(
    model_config: ModelConfig,
    config: EngineConfig,
    weights,
    decode: Decode | None = None,
    kv_cache: torch.Tensor | None = None,
    grammars: GrammarCache | None = None,
    tp_group=None,  # rank 0 of a workers.parallel.group.TPGroup: weights are its shard
    draft_kv: AllocateKV | None = None,  # where a draft model's KV cache lives (default: its own tensor)
    lora_sharding: LoRASharding | None = None,  # a tensor-parallel rank's cut of LoRA adapters
) -> LLMEngine:
    """An engine on `weights` (a checkpoint's (name, tensor) pairs, or a model load_model built),
    with its KV cache (`kv_cache`: one allocated already, e.g. by the worker's transport) and the
    speculator its config asks for."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)  # before loading: the weights load on these threads
    runner = ModelRunner(
        model_config, config, weights, kv_cache=kv_cache, tp_group=tp_group, lora_sharding=lora_sharding
    )
    speculator = Speculator.for_engine(config, model_config, runner, runner.context_limit, draft_kv)
    return LLMEngine(model_config, config, runner, decode, grammars, speculator)


def load_engine(model: str | os.PathLike | None = None, config: EngineConfig | None = None, **kwargs) -> LLMEngine:
    """An engine on the model in folder `model` (None: the default model; resolve_model_dir), with
    its tokenizer's decode and grammar cache; kwargs go to build_engine."""
    model_dir = resolve_model_dir(model)
    model_config = ModelConfig.from_model_dir(model_dir)
    kwargs.setdefault("grammars", GrammarCache(model_dir, model_config.vocab_size, model_config.eos_token_ids))
    return build_engine(
        model_config, config or EngineConfig(), iter_safetensors(model_dir), load_tokenizer_decode(model_dir), **kwargs
    )


def load_tokenizer_decode(model_dir: Path) -> Decode | None:
    """A decode function from the folder's tokenizer.json, skipping special tokens."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
