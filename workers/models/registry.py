"""The model class of each supported architecture (workers.models.files.SUPPORTED_ARCHITECTURES)."""

from __future__ import annotations

from workers.models.gemma import GemmaForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MoeForCausalLM

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
