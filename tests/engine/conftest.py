"""Fixtures for engine tests: the default model, its prompts and transformers' greedy answers."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import Reference, hf_greedy
from workers.evaluation import PROMPTS

NEW_TOKENS = 64

# The first 19 evaluation prompts and, in chat_prompts, a long document: 20 prompts, one over 1,000 tokens.
QUESTIONS = PROMPTS[:19]


def long_document(tokenizer, min_tokens: int = 1100) -> str:
    """Offline English text from the standard library's pydoc topics, at least min_tokens long."""
    from pydoc_data.topics import topics

    text = ""
    for key in sorted(topics):
        text += topics[key]
        if len(tokenizer(text)["input_ids"]) > min_tokens:
            return text
    raise AssertionError("pydoc topics too short")


@pytest.fixture(scope="session")
def default_model_dir():
    from workers.model_files import resolve_model_dir

    return resolve_model_dir(quiet=True)


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(hf_tokenizer) -> list[list[int]]:
    doc = long_document(hf_tokenizer)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    messages.append([{"role": "user", "content": doc + "\n\nSummarize the text above in one sentence."}])
    prompts = [hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"] for m in messages]
    assert max(len(p) for p in prompts) > 1000
    return prompts


@pytest.fixture(scope="session")
def hf_references(request, chat_prompts, default_model_dir):
    """transformers' greedy answers (tokens and logits per step) to chat_prompts.

    Computed once per machine and kept under pytest's cache (`--cache-clear` drops it): the key
    holds everything the numbers depend on (the model files' bytes, the prompts, NEW_TOKENS, the
    versions of transformers and torch, torch's thread count, this CPU, hf_greedy's source), so a
    kept answer is bit for bit the one a fresh run computes. The model loads only to compute them."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(default_model_dir).eos_token_id
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        folder = cache.mkdir("baton_hf_references")
        kept = folder / f"{reference_key(default_model_dir, chat_prompts, NEW_TOKENS, eos)}.pt"
        if kept.exists():
            saved = torch.load(kept, weights_only=True)
            return [Reference(tokens, list(logits.unbind(0)))
                    for tokens, logits in zip(saved["tokens"], saved["logits"])]
    hf_model = request.getfixturevalue("hf_model")
    assert hf_model.generation_config.eos_token_id == eos
    with torch.inference_mode():
        references = [hf_greedy(hf_model, p, NEW_TOKENS, eos_token_id=eos) for p in chat_prompts]
    if cache is None:
        return references
    for old in folder.glob("*.pt"):  # one kept answer per machine (about 170 MB of logits)
        old.unlink(missing_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}.partial")  # another session may be writing too
    torch.save({"tokens": [r.token_ids for r in references],
                "logits": [torch.stack(r.logits) for r in references]}, partial)
    os.replace(partial, kept)
    return references


def reference_key(model_dir, prompts: list[list[int]], new_tokens: int, eos_token_id) -> str:
    """A digest of every input of the transformers references (see hf_references)."""
    import transformers

    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            digest.update(f.name.encode())
            with f.open("rb") as data:
                for block in iter(lambda: data.read(1 << 20), b""):
                    digest.update(block)
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines()
           if line.startswith(("model name", "flags"))][:2] if Path("/proc/cpuinfo").exists() else []
    digest.update(json.dumps({
        "prompts": prompts, "new_tokens": new_tokens, "eos": eos_token_id, "transformers": transformers.__version__,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(), "cpu": cpu,
        "oracle": inspect.getsource(hf_greedy) + inspect.getsource(Reference)}, default=str).encode())
    return digest.hexdigest()[:32]
