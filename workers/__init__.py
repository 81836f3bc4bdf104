"""The engine and the Ray worker shells, in layers (each imports only those above it in this list):

- `workers.config`: the worker's and the engine's configuration (dataclasses, torch-free).
- `workers.quantization`: FP8 weights and oneDNN-prepacked linear layers.
- `workers.models`: the model families, their config.json and checkpoint files.
- `workers.engine`: the engine core (LLMEngine, scheduler, block manager, model runner, sampler).
- `workers.parallel`: tensor parallelism (the rank group, sharding, a non-zero rank).
- `workers.speculative`: speculative decoding (proposers, draft model, when drafts pay).
- `workers.build`: builds an LLMEngine with its model runner and speculator.
- `workers.shell`: the worker shell (EngineWorker) and its Ray actors.

Importing this package is cheap and torch-free; torch loads with the engine modules that need it.
"""
