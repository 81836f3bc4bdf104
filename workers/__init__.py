"""The engine (sequences, paged KV blocks, scheduler, model runner, sampler) and the Ray worker shells.

Importing this package is cheap and torch-free; torch loads with the engine modules that need it.
"""
