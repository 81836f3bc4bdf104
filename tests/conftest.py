"""Shared fixtures: the default model, its transformers oracle, tiny random models."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton fixes interpreter mode when it is first imported, and the engine imports it early: set it
# for the whole session so the kernel tests can run their kernels on CPU tensors. The GPU script
# sets TRITON_INTERPRET=0 to compile them instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
