"""The model families, torch-free: each module declares its `FAMILIES` (workers.models.family.ModelFamily:
architectures, model class, config hook, capabilities); workers/models/registry.py lists the modules once."""
