"""The engine core: requests, sequences, paged KV blocks, scheduler, model runner, sampler, one process.

Torch-free to import (the simulator uses the scheduler and block manager); torch loads with the
modules that need it. The engine receives its speculator (workers.speculative) from the builder
(workers.build) and knows it only through workers.engine.speculation.
"""
