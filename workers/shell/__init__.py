"""The worker shell around the engine: EngineWorker (its thread, KV transfers, the router's calls)
and the Ray actors that host it."""
