"""Runs the model over a scheduled batch: loads it (workers.engine.loader) beside its paged KV
cache (workers.engine.kv_cache says the layout), turns the batch into tensors (StepInputs), runs
the forward pass eagerly, through a CPU layer stack or by replaying a CUDA graph, and, in a
tensor-parallel group, broadcasts each step to the other ranks or follows rank 0's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from workers.config import EngineConfig
from workers.engine.cpu_layer_stack import attach_stack_lora, cpu_layer_stack, stack_hidden, stack_lora_rows
from workers.engine.cuda_graphs import (
    DecodeGraphs,
    GraphBuckets,
    cuda_graph_factory,
    decode_graphs_wanted,
    graph_batch_sizes,
)
from workers.engine.kv_cache import kv_cache_num_blocks, kv_cache_torch_dtype
from workers.engine.loader import TORCH_DTYPES, kv_cache_scales, load_model
from workers.engine.sequence import StepChunk
from workers.engine.step_inputs import StepInputs
from workers.lora.adapter import LoRASharding
from workers.lora.layers import attach_lora
from workers.lora.manager import LoRAManager
from workers.models.config import ModelConfig
from workers.models.llama import AttentionMetadata, KVCacheView, LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        weights,
        kv_cache: torch.Tensor | None = None,
        tp_group=None,
        lora_sharding: LoRASharding | None = None,
    ):
        self.model_config = model_config
        # A tensor-parallel group of more than one rank (workers.parallel.group.TPGroup): rank 0
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
                    "(from workers.engine.loader.kv_cache_scales on the checkpoint)"
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
        # Decode steps replay CUDA graphs (workers/engine/cuda_graphs.py), captured now that the KV cache
        # and its scales exist; None (the CPU, --enforce-eager) runs every step eagerly. The graphs
        # hold the cache's address: it is written in place (KV handoff included), never replaced.
        self.decode_graphs: DecodeGraphs | None = None
        # Not with tensor parallelism yet: a replayed graph would skip the step's broadcast.
        # LoRA: decode graphs would replay one step's adapter rows; steps with adapters run eagerly.
        eager_graphs = engine_config.enforce_eager or engine_config.lora_enabled
        if self.tp_group is None and decode_graphs_wanted(eager_graphs, self.device, self.ops.backend):
            self.capture_decode_graphs(cuda_graph_factory())
        # On the CPU, steps run the decoder layers in one native call where the model allows
        # (workers/engine/cpu_layer_stack.py); it holds the cache's and the packed weights' addresses.
        self.layer_stack = (
            None
            if engine_config.enforce_eager
            else cpu_layer_stack(self.model, kv_cache, self.tp_group, engine_config.float32_prompt_matmul)
        )
        # LoRA adapters (workers/lora): the projections add each row's adapter update. Attached after
        # the layer stack, which keeps the base weights: a step without adapter rows still runs
        # natively, one with them layer by layer.
        self.lora = self._attach_lora(engine_config, lora_sharding) if engine_config.lora_enabled else None

    def _attach_lora(self, engine_config: EngineConfig, sharding: LoRASharding | None) -> LoRAManager:
        if self.tp_group is not None and sharding is None:
            raise ValueError(
                "a tensor-parallel rank serving LoRA adapters needs its LoRASharding (ShardPlan.lora_sharding)"
            )
        if not all(hasattr(layer.mlp, "gate_up_proj") for layer in self.model.layers):
            raise ValueError(
                f"LoRA adapters are served on dense Llama-family models, not {self.model_config.architecture}"
            )
        manager = LoRAManager(
            self.model_config, engine_config.lora_limits, engine_config.lora_specs, self.dtype, self.device, sharding
        )
        attach_lora(self.model, manager)
        if self.layer_stack is not None:
            attach_stack_lora(self.layer_stack, manager)
        return manager

    @property
    def context_limit(self) -> int:
        """The longest sequence this runner serves: max_model_len, or fewer tokens where its KV cache holds fewer."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

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
    def execute(self, chunks: Sequence[StepChunk], sample_mask: list[bool]) -> torch.Tensor:
        """Run one step. chunks must list single-token (decode) chunks first.

        Returns float32 logits, in chunk order, for the last token of each chunk whose sample_mask
        entry is True; a chunk with drafts (speculative decoding) gets a row for each of its last
        1 + len(draft_token_ids) positions. [rows, vocab]
        """
        hidden, logits_index = self._forward(chunks, sample_mask)
        return self.model.compute_logits(hidden[logits_index])

    @torch.inference_mode()
    def next_token_logprobs(self, chunk: StepChunk, rows_per_slice: int = 256) -> torch.Tensor:
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

    def _forward(self, chunks: Sequence[StepChunk], sample_mask: list[bool]) -> tuple[torch.Tensor, list[int]]:
        step = StepInputs.of(chunks, sample_mask, self.block_size)
        if self.lora is not None:
            step = self._with_lora_rows(step, chunks)
        graphs = self.decode_graphs
        if graphs is not None and step.num_decode == len(step.input_ids) and graphs.fits(step.decode_rows):
            # Decode only: replay the bucket's graph; the rows past num_decode are padding, not returned.
            return graphs.run(
                step.input_ids, step.positions, step.slots, step.decode_rows, step.decode_lens
            ), step.logits_index
        if self.tp_group is not None:
            self.tp_group.broadcast_step(step)  # the other ranks run the same step on their shards
        return self.forward(step), step.logits_index

    def _with_lora_rows(self, step: StepInputs, chunks: Sequence[StepChunk]) -> StepInputs:
        """The step with each token row's adapter slot (none where every row runs the base model),
        loading into the slots the adapters it needs."""
        assert self.lora is not None
        names = [c.seq.adapter for c in chunks]
        if not any(names):
            return step
        slots = self.lora.slots_for(names)
        rows = [s for c, s in zip(chunks, slots) for _ in range(c.num_tokens)]
        return dataclasses.replace(step, lora_rows=rows, lora_slots=self.lora.slot_table())

    def _use_lora_rows(self, step: StepInputs) -> None:
        assert self.lora is not None
        if step.lora_rows is None:
            self.lora.row_slots = None
            return
        self.lora.adopt(step.lora_slots)  # rank 0 holds them already; the other ranks copy its slots
        # int64: what the native kernel and the layer stack take (kernels/lora.py), made once a step.
        self.lora.row_slots = torch.tensor(step.lora_rows, dtype=torch.int64, device=self.device)
        self.lora.active_targets = self.lora.targets_of(step.lora_rows)

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
        if self.lora is not None:
            self._use_lora_rows(step)
        with torch.inference_mode():
            lora = self.lora if self.lora is not None and self.lora.row_slots is not None else None
            stack = self.layer_stack
            if (
                stack is not None
                and (lora is None or stack.takes_lora)
                and (stack.takes_prefill or not step.prefill_rows)
            ):
                runs = torch.tensor(step.prompt_runs, dtype=torch.int64).reshape(-1, 2) if step.prompt_runs else None
                adapter_rows = None if lora is None else stack_lora_rows(lora)
                return stack_hidden(self.model, stack, input_ids, positions, meta, runs, adapter_rows)
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
