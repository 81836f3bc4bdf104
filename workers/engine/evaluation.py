"""The evaluation texts of the FP8 accuracy check (bench/fp8_accuracy.py and its short version in
tests/fp8): 1024-token windows of Python's pydoc topics (in every Python install, so no
download) and twenty one-line chat prompts. Torch-free; the tokenizer is a transformers one."""

from __future__ import annotations

__all__ = ["CHUNK", "PROMPTS", "WINDOW", "chat_prompts", "eval_windows"]

WINDOW = 1024
CHUNK = 256
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three primary colors.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to code.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in two sentences.",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a friendly robot.",
    "Summarize the plot of Cinderella briefly.",
    "How many legs does a spider have?",
    "What does CPU stand for?",
    "Tell me a fun fact about octopuses.",
    "Write one sentence encouraging someone before an exam.",
    "What is photosynthesis?",
    "Name two planets larger than Earth.",
]


def eval_windows(tokenizer, windows: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < windows * WINDOW:
        raise SystemExit(f"pydoc topics give {len(ids)} tokens, fewer than {windows} windows of {WINDOW}")
    return [ids[i * WINDOW : (i + 1) * WINDOW] for i in range(windows)]


def chat_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for q in PROMPTS
    ]
