"""Oracle helpers for engine tests: transformers greedy runs and the near-tie comparison rule."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

LOGIT_TOL = 1e-3  # fp32, different summation order
NEAR_TIE = 1e-3  # a divergence is allowed only where the reference's top-2 gap is below this


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # one [vocab] float32 row per generated token


def interpreter_ready() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1 (its library functions are
    interpretable), as tests/conftest.py arranges for the whole session; a test of the Triton path
    then runs its engines in this process, otherwise in a child started with the variable set."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.sum, InterpretedFunction)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> Reference:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [row[0].float() for row in out.logits])


@dataclass
class Comparison:
    diverged_at: int | None  # first differing step, None when identical
    max_logit_error: float  # over steps before the divergence (nan when logits not given)


def compare_greedy(
    ours: list[int],
    ref: Reference,
    our_logits: list[torch.Tensor] | None = None,
    logit_tol: float = LOGIT_TOL,
    near_tie: float = NEAR_TIE,
) -> Comparison:
    """Check ours against the reference by the rule in the tests' docstrings; raise AssertionError if broken.

    Tokens must match until the first difference; at that step the reference's top-2 logit gap
    must be below near_tie (floating-point order can flip a near tie), and every earlier step's
    logits must agree within logit_tol. A shorter output must stop where the reference stops.
    """
    n = min(len(ours), len(ref.token_ids))
    diverged = next((i for i in range(n) if ours[i] != ref.token_ids[i]), None)
    if diverged is None and len(ours) != len(ref.token_ids):
        raise AssertionError(f"lengths differ with equal tokens: ours {len(ours)} vs reference {len(ref.token_ids)}")
    checked = n if diverged is None else diverged
    max_err = float("nan")
    if our_logits is not None:
        errs = [float((our_logits[i] - ref.logits[i]).abs().max()) for i in range(checked)]
        max_err = max(errs, default=0.0)
        assert max_err < logit_tol, f"logits differ by {max_err:.2e} before any divergence (tolerance {logit_tol})"
    if diverged is not None:
        top2 = torch.topk(ref.logits[diverged], 2).values
        gap = float(top2[0] - top2[1])
        assert gap < near_tie, (
            f"tokens diverge at step {diverged} (ours {ours[diverged]}, reference {ref.token_ids[diverged]}) "
            f"where the reference's top-2 gap is {gap:.2e}, not a near tie"
        )
    return Comparison(diverged, max_err)


def write_word_tokenizer(folder: str, vocab_size: int = 512) -> None:
    """A word-level tokenizer.json naming token i "t{i}": what the router needs to serve a tiny
    folder, and its logprobs then name the token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(Path(folder) / "tokenizer.json"))


def save_tiny_model(kind: str, **overrides) -> tuple[str, torch.nn.Module]:
    """A tiny random transformers model of the given family, saved to a temp folder (removed when
    the test process exits: module-scoped fixtures share it, and served tests hand it to workers)."""
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **common})
        cls = transformers.MistralForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "phi3":
        config = transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        cls = transformers.Phi3ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            **{"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None, **common}
        )
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, **common}
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "gemma2":  # needs eager attention for its soft-capping, as transformers says
        config = transformers.Gemma2Config(**{"attn_implementation": "eager", **common})
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**{"attn_implementation": "eager", **common})
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(1234)
    model = cls(config).eval()
    # Random init gives tiny biases of zero; make them matter so a dropped bias fails the test.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # ones would hide a norm left out
                p.uniform_(0.5, 1.5)
            elif name.endswith(".gate.weight"):  # an MoE router: decisive, so top-k is not a coin flip
                p.normal_(0, 0.5)
            elif kind.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's (1 + w): zeros would hide it
                p.normal_(0, 0.3)
            elif kind.startswith("gemma") and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0, 0.25)  # attention logits of a few units, where soft-capping bites
    folder = tempfile.mkdtemp(prefix=f"baton-tiny-{kind}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)
    return folder, model


def run_with_logits(engine, prompts: list[list[int]], params) -> tuple[list, list[list[torch.Tensor]]]:
    """engine.generate, also recording the logits each prompt was sampled from at every step."""
    recorded: dict[tuple[int, ...], list[torch.Tensor]] = {tuple(p): [] for p in prompts}
    real_sampler = engine.sampler

    def recording_sampler(logits, rows):
        for row_logits, row in zip(logits, rows):
            recorded[tuple(row.prompt_token_ids)].append(row_logits.clone())
        return real_sampler(logits, rows)

    engine.sampler = recording_sampler
    try:
        completions = engine.generate(prompts, params)
    finally:
        engine.sampler = real_sampler
    return completions, [recorded[tuple(p)] for p in prompts]


@contextlib.contextmanager
def worker_pair(model_dir, config):
    """A prefill and a decode EngineWorker in this process (no Ray), KV over shared memory; shut down after."""
    from workers.shell.worker import EngineWorker, WorkerConfig

    prefill = EngineWorker(WorkerConfig("p0", "prefill", str(model_dir), config, transport="shm"))
    decode = EngineWorker(WorkerConfig("d0", "decode", str(model_dir), config, transport="shm"))
    try:
        yield prefill, decode
    finally:
        prefill.shutdown()
        decode.shutdown()


def handoff(prefill, decode, request_id, prompt, params):
    """One request through the pair: D reserves, P prefills into the blocks, D decodes to the end.
    Returns (every token, P's PrefillResult, D's reservation, the finish reason)."""
    from testkit import workers

    reservation = workers.reserve(decode, request_id, prompt, params)
    assert reservation is not None
    result = workers.prefill(prefill, request_id, prompt, params, decode.endpoint(), reservation)
    tokens = list(result.output.token_ids)
    if result.output.finished:
        workers.abort(decode, request_id)
        return tokens, result, reservation, result.output.finish_reason
    workers.start_decode(decode, request_id, tokens[0])
    while True:
        outputs = decode.poll_outputs(5.0)
        assert outputs, "decode worker produced nothing for 5 s"
        for out in outputs:
            tokens += out.token_ids
            if out.finished:
                return tokens, result, reservation, out.finish_reason


def save_lora_adapter(
    base: torch.nn.Module, folder: Path, rank: int, alpha: int, targets: list[str], seed: int, std: float = 0.3
) -> None:
    """A PEFT LoRA adapter of `base` (rank, alpha, target modules) with random A and B (standard
    deviation `std`: the default changes a tiny model's greedy tokens), saved in PEFT's format to
    `folder`; `base` is left as it was."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(str(folder))
    model.unload()


def poll_until(worker, request_id: str, tokens: list[int], count: int | None) -> list[int]:
    """Append `worker`'s outputs for the request until it finished (or holds `count` tokens)."""
    while count is None or len(tokens) < count:
        outputs = worker.poll_outputs(5.0)
        assert outputs, f"{worker.worker_id} produced nothing for 5 s"
        for out in outputs:
            if out.request_id != request_id:  # what a request taken away had left in the worker's queue
                continue
            tokens += out.token_ids
            if out.finished:
                return tokens
    return tokens
