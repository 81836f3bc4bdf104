"""transformers' greedy answers (tokens and logits per step) to the engine tests' chat prompts,
kept under pytest's cache, and their computation in the background.

On a machine without them kept (a fresh checkout, every CI run) they cost about a minute of CPU,
which the tests that need them would wait for. When a session collects such a test,
`start_in_background` runs `python -m tests.engine.references FOLDER` at the lowest CPU priority,
so the work fills the time the earlier Ray tests leave a core idle (they wait on leases, restarts
and streams) and takes little from them; the `hf_references` fixture waits for that process and
reads its file, or computes them itself when it did not produce one. The file's key holds
everything the numbers depend on (see `reference_key`), so either way they are bit for bit what a
fresh in-process computation gives.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import Reference, hf_greedy
from tests.idle_priority import popen_at_lowest_priority
from workers.engine.evaluation import PROMPTS

NEW_TOKENS = 64
CACHE_FOLDER = "baton_hf_references"  # under pytest's cache (config.cache.mkdir)
BACKGROUND = pytest.StashKey[subprocess.Popen]()  # the session's background computation, if any
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


def chat_prompt_ids(hf_tokenizer) -> list[list[int]]:
    doc = long_document(hf_tokenizer)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    messages.append([{"role": "user", "content": doc + "\n\nSummarize the text above in one sentence."}])
    prompts = [
        hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"] for m in messages
    ]
    assert max(len(p) for p in prompts) > 1000
    return prompts


def reference_key(model_dir, prompts: list[list[int]], new_tokens: int, eos_token_id) -> str:
    """A digest of every input of the transformers references."""
    import transformers

    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            digest.update(f.name.encode())
            with f.open("rb") as data:
                for block in iter(lambda: data.read(1 << 20), b""):
                    digest.update(block)
    cpu = (
        [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("model name", "flags"))][
            :2
        ]
        if Path("/proc/cpuinfo").exists()
        else []
    )
    digest.update(
        json.dumps(
            {
                "prompts": prompts,
                "new_tokens": new_tokens,
                "eos": eos_token_id,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
                "cpu": cpu,
                "oracle": inspect.getsource(hf_greedy) + inspect.getsource(Reference),
            },
            default=str,
        ).encode()
    )
    return digest.hexdigest()[:32]


def load(path: Path) -> list[Reference] | None:
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=True)
    return [Reference(tokens, list(logits.unbind(0))) for tokens, logits in zip(saved["tokens"], saved["logits"])]


def compute(hf_model, prompts: list[list[int]], eos_token_id) -> list[Reference]:
    assert hf_model.generation_config.eos_token_id == eos_token_id
    with torch.inference_mode():
        return [hf_greedy(hf_model, p, NEW_TOKENS, eos_token_id=eos_token_id) for p in prompts]


def store(path: Path, references: list[Reference]) -> None:
    """Write them as `path`, the only kept answer in its folder (about 170 MB of logits)."""
    for old in path.parent.glob("*.pt"):
        if old != path:
            old.unlink(missing_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # another session may be writing too
    torch.save(
        {"tokens": [r.token_ids for r in references], "logits": [torch.stack(r.logits) for r in references]}, partial
    )
    os.replace(partial, path)


def start_in_background(folder: Path) -> subprocess.Popen:
    """`python -m tests.engine.references folder` at the lowest CPU priority (tests/idle_priority.py),
    its output in folder/background.log."""
    repo = Path(__file__).resolve().parents[2]
    with (folder / "background.log").open("w") as log:
        return popen_at_lowest_priority(
            [sys.executable, "-m", "tests.engine.references", str(folder)],
            cwd=repo,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(repo)),
        )


def main(folder: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from workers.models.files import resolve_model_dir

    model_dir = resolve_model_dir(quiet=True)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir))
    path = Path(folder) / f"{reference_key(model_dir, prompts, NEW_TOKENS, eos)}.pt"
    if not path.exists():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        store(path, compute(model, prompts, eos))
    print(f"references in {path}")


if __name__ == "__main__":
    main(sys.argv[1])
