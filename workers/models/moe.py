"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE) on llama.py's layers.

Attention, norms, embeddings and the lm_head are llama.py's (Qwen3-MoE's per-head q/k RMSNorm is
ModelConfig.qk_norm, as for Qwen3 dense). Each MoE layer's MLP is a SparseMoeBlock: a router
(hidden -> experts logits; softmax in float32 over all experts, top k, renormalised when
ModelConfig.norm_topk_prob: always for Mixtral, which is the same as a softmax over the top-k
logits) and the experts' weights stacked as w13 [E, 2I, H] (gate rows then up rows, fused at load)
and w2 [E, H, I], applied by KernelOps.fused_moe (kernels/fused_moe.py: Triton on CUDA, per-expert
batched matmuls on the CPU). Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep
llama.py's MLP. Shared experts: neither family has any (Qwen2-MoE's shared expert is not supported).

Checkpoint layouts read: per expert (Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`, Qwen3-MoE
`mlp.experts.{e}.gate_proj/up_proj/down_proj`: published checkpoints, and what transformers 5's
save_pretrained writes) and fused 3-D (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], transformers 5's in-memory layout).

Tensor parallelism (workers.parallel): attention as llama.py's; the router is whole on every
rank; the experts are split either by their intermediate channels (each rank holds every expert's
1/N, as a dense MLP) or, with expert parallelism, whole (each rank holds 1/N of the experts and
runs only the (token, slot) pairs routed to them). Either way each rank's sum is partial and one
all-reduce per MoE layer completes it.

FP8 weights: with `--quantization fp8` every linear layer but the router is llama.py's Fp8Linear
and the experts are quantized per expert and output row (MoeExperts.quantize_fp8); a pre-quantized
checkpoint (per-expert tensors with weight_scale or weight_scale_inv: per tensor, per channel or in
blocks, as Qwen3-*-FP8 publishes them) loads as it is (MoeExperts.prepare_fp8_checkpoint). A step
dequantizes only the experts its tokens are routed to.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.ops import KernelOps
from workers.models.config import ModelConfig
from workers.models.llama import AllReduce, LlamaForCausalLM
from workers.quantization import fp8 as q8

MOE_PREFIXES = ("mlp", "block_sparse_moe")  # Qwen3-MoE, Mixtral
GATE_ROWS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # which half of w13 a projection fills
DOWN = ("w2", "down_proj")


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts, then the top k."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoeExperts(nn.Module, q8.Fp8Weights):
    """The experts' stacked weights; after `quantize_fp8`, float8_e4m3fn with one float32 scale per
    expert and output row (w13_scale [E, 2I, 1], w2_scale [E, H, 1]), as Fp8Linear's per-channel."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        # Input columns per scale of w13 and w2 (their whole rows per channel).
        self.group_sizes: tuple[int, ...] = (0, 0)

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def prepare_fp8_checkpoint(self, quant: q8.CheckpointQuantization) -> None:
        """Empty FP8 weights and float32 scales [E, rows, groups] for a pre-quantized checkpoint to fill."""
        scales = []
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(self, name).shape
            device = getattr(self, name).device  # meta while the model is built: nothing is allocated yet
            setattr(
                self,
                name,
                nn.Parameter(torch.empty(experts, rows, cols, dtype=q8.FP8_DTYPE, device=device), requires_grad=False),
            )
            scale = torch.ones(experts, rows, quant.groups(cols), dtype=torch.float32, device=device)
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
            scales.append(quant.group_size(cols))
        self.group_sizes = tuple(scales)

    def quantize_fp8(self) -> None:
        """Load-time quantization (`--quantization fp8`) of the loaded float weights."""
        for name in ("w13", "w2"):
            weight = getattr(self, name).data
            experts, rows, cols = weight.shape
            q, scale = q8.quantize_per_channel(weight.reshape(experts * rows, cols))
            setattr(self, name, nn.Parameter(q.reshape(experts, rows, cols), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale.reshape(experts, rows, 1), requires_grad=False))
        self.group_sizes = (self.w13.shape[2], self.w2.shape[2])

    def fp8_params(self) -> list[nn.Parameter]:
        """The tensors a dtype cast must leave as they are."""
        if self.w13_scale is None or self.w2_scale is None:  # not FP8
            return []
        return [self.w13, self.w2, self.w13_scale, self.w2_scale]

    def weights_for(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13, w2, ids) to run `ids` [T, k] on: the weights as they are, or with FP8 experts only
        the experts `ids` name, dequantized to float32 and renumbered in `ids` (the rest are not read)."""
        if self.w13_scale is None or self.w2_scale is None:  # not FP8
            return self.w13, self.w2, ids
        used, renumbered = torch.unique(ids, return_inverse=True)
        w13 = _dequantize(self.w13[used], self.w13_scale[used], self.group_sizes[0])
        w2 = _dequantize(self.w2[used], self.w2_scale[used], self.group_sizes[1])
        return w13, w2, renumbered


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [E, rows, cols] from FP8 weights and scales [E, rows, groups] of group_size columns each
    (workers.quantization.fp8.dequantize, each expert's rows one after the other)."""
    experts, rows, cols = weight.shape
    flat = q8.dequantize(weight.reshape(experts * rows, cols), scale.reshape(experts * rows, -1), group_size)
    return flat.reshape(experts, rows, cols)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp_group: AllReduce | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.float_children = ("gate",)  # --quantization fp8 leaves the router in float (as vLLM does)
        self.local = config.local_experts  # expert parallelism: the experts [start, stop) held here
        held = config.num_experts if self.local is None else self.local[1] - self.local[0]
        self.experts = MoeExperts(held, config.hidden_size, config.moe_intermediate_size)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)
        if self.local is None:
            w13, w2, ids = self.experts.weights_for(ids)
            out = self.ops.fused_moe(x, w13.to(x.dtype), w2.to(x.dtype), weights, ids)
        else:
            out = self._local_experts(x, weights, ids)
        return out if self.tp_group is None else self.tp_group.all_reduce(out)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The (token, slot) pairs routed to the experts held here, each as a row of its own with
        top-1 routing, summed back into their tokens (the other ranks add the rest)."""
        assert self.local is not None  # forward runs this only with local experts
        start, stop = self.local
        token, slot = ((ids >= start) & (ids < stop)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if token.numel():
            w13, w2, local_ids = self.experts.weights_for(ids[token, slot, None] - start)
            rows = self.ops.fused_moe(x[token], w13.to(x.dtype), w2.to(x.dtype), weights[token, slot, None], local_ids)
            out.index_add_(0, token, rows.to(out.dtype))
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with a SparseMoeBlock as the MLP of every MoE layer."""

    def __init__(self, config: ModelConfig, ops: KernelOps, tp_group: AllReduce | None = None) -> None:
        if config.num_experts < 1:
            raise ValueError(f"{config.architecture}: MoeForCausalLM needs num_experts >= 1")
        super().__init__(config, ops, tp_group)
        dense = set(config.dense_mlp_layers)
        for i, layer in enumerate(self.layers):
            if i not in dense:
                layer.mlp = SparseMoeBlock(config, ops, tp_group)

    def load_hf_weights(self, weights, quant=None) -> None:
        """The MoE blocks' tensors load here; everything else through LlamaForCausalLM's loader.
        With quant (a pre-quantized FP8 checkpoint, per expert: each projection's weight and its
        weight_scale or weight_scale_inv), the experts were made FP8 by prepare_fp8_checkpoint."""
        blocks = {i: layer.mlp for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoeBlock)}
        loader = _ExpertLoader(blocks, quant)
        # The dense loader checks that every parameter it sees was loaded: it must not see the MoE blocks.
        for i in blocks:
            delattr(self.layers[i], "mlp")  # unregisters the submodule
        try:
            super().load_hf_weights(((n, t) for n, t in weights if not loader.take(n, t)), quant)
        finally:
            for i, block in blocks.items():
                self.layers[i].mlp = block
        loader.check_complete()


class _ExpertLoader:
    """Copies router and expert tensors into the SparseMoeBlocks and records which pieces arrived."""

    def __init__(self, blocks: dict[int, SparseMoeBlock], quant: q8.CheckpointQuantization | None = None) -> None:
        self.blocks = blocks
        self.quant = quant
        self.loaded: set[tuple] = set()

    def take(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """True when hf_name is a tensor of an MoE block (and is loaded now)."""
        parts = hf_name.removeprefix("model.").split(".")
        if len(parts) < 4 or parts[0] != "layers" or parts[2] not in MOE_PREFIXES or int(parts[1]) not in self.blocks:
            return False
        layer = int(parts[1])
        block = self.blocks[layer]
        rest = parts[3:]
        fp8 = block.experts.is_fp8
        if rest[-1] == "input_scale":
            return True  # activations stay in the model dtype: a static activation scale is not used
        if not fp8 and (rest[-1] in ("weight_scale", "weight_scale_inv") or tensor.dtype == torch.float8_e4m3fn):
            raise ValueError(f"{hf_name}: an FP8 expert weight, but config.json has no quantization_config")
        if fp8 and rest[-1] in ("weight_scale", "weight_scale_inv"):
            return self._take_scale(hf_name, block, rest, tensor, layer)
        if fp8 and rest[-1] == "weight" and tensor.dtype != torch.float8_e4m3fn and rest[:1] == ["experts"]:
            raise ValueError(f"{hf_name}: a {tensor.dtype} expert weight in an FP8 checkpoint")
        w13, w2 = block.experts.w13.data, block.experts.w2.data
        inter = w2.shape[2]
        if rest == ["gate", "weight"]:
            self._put(hf_name, block.gate.weight.data, tensor, (layer, "gate"))
        elif rest in (["experts", "gate_up_proj"], ["experts", "gate_up_proj", "weight"]):
            self._put(hf_name, w13, tensor, *((layer, "w13", e, h) for e in range(w13.shape[0]) for h in (0, 1)))
        elif rest in (["experts", "down_proj"], ["experts", "down_proj", "weight"]):
            self._put(hf_name, w2, tensor, *((layer, "w2", e) for e in range(w2.shape[0])))
        elif len(rest) == 4 and rest[0] == "experts" and rest[3] == "weight" and rest[1].isdigit():
            e, proj = int(rest[1]), rest[2]
            if e >= w13.shape[0]:
                raise ValueError(f"{hf_name}: expert {e} but the model has {w13.shape[0]} experts")
            if proj in GATE_ROWS:
                half = GATE_ROWS[proj]
                self._put(hf_name, w13[e, half * inter : (half + 1) * inter], tensor, (layer, "w13", e, half))
            elif proj in DOWN:
                self._put(hf_name, w2[e], tensor, (layer, "w2", e))
            else:
                raise ValueError(f"{hf_name}: unknown expert projection {proj!r}")
        else:
            raise ValueError(f"checkpoint tensor {hf_name} is not a router or expert weight this loader knows")
        return True

    def _take_scale(
        self, hf_name: str, block: SparseMoeBlock, rest: list[str], tensor: torch.Tensor, layer: int
    ) -> bool:
        """One expert projection's FP8 scale, expanded to [rows, groups] (CheckpointQuantization.expand_scale)."""
        if not (len(rest) == 4 and rest[0] == "experts" and rest[1].isdigit()):
            raise ValueError(f"{hf_name}: FP8 scales of fused expert tensors are not supported (per-expert only)")
        e, proj = int(rest[1]), rest[2]
        experts, quant = block.experts, self.quant
        # take() loads scales into FP8 experts only, prepared for the checkpoint's quantization.
        assert experts.w13_scale is not None and experts.w2_scale is not None and quant is not None
        if e >= experts.w13.shape[0]:
            raise ValueError(f"{hf_name}: expert {e} but the model has {experts.w13.shape[0]} experts")
        inter, hidden = experts.w2.shape[2], experts.w2.shape[1]
        if proj in GATE_ROWS:
            half = GATE_ROWS[proj]
            target = experts.w13_scale.data[e, half * inter : (half + 1) * inter]
            self._put(
                hf_name, target, quant.expand_scale(tensor, inter, hidden, hf_name), (layer, "w13_scale", e, half)
            )
        elif proj in DOWN:
            self._put(
                hf_name,
                experts.w2_scale.data[e],
                quant.expand_scale(tensor, hidden, inter, hf_name),
                (layer, "w2_scale", e),
            )
        else:
            raise ValueError(f"{hf_name}: unknown expert projection {proj!r}")
        return True

    def _put(self, name: str, target: torch.Tensor, tensor: torch.Tensor, *pieces: tuple) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        target.copy_(tensor)
        self.loaded.update(pieces)

    def check_complete(self) -> None:
        expected: set[tuple] = set()
        for layer, block in self.blocks.items():
            experts = block.experts.w13.shape[0]
            expected |= {(layer, "gate")} | {(layer, "w2", e) for e in range(experts)}
            expected |= {(layer, "w13", e, h) for e in range(experts) for h in (0, 1)}
            if block.experts.is_fp8:
                expected |= {(layer, "w2_scale", e) for e in range(experts)}
                expected |= {(layer, "w13_scale", e, h) for e in range(experts) for h in (0, 1)}
        missing = sorted(expected - self.loaded, key=str)
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} router/expert tensors, e.g. {missing[:4]} "
                "(layer, weight, expert, half)"
            )
