"""The torch-free vocabulary every Baton package shares: wire dataclasses (requests, outputs,
KV events, layouts, endpoints), sampling parameters, block hashes, roles and the environment
variables Baton reads.

This package sits at the bottom of the layering: it imports nothing else of the project (only
the standard library and small dependencies such as xxhash), and never torch, so the router
can use it freely.
"""
