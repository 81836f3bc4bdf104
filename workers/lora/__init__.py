"""LoRA adapters in the engine: read from PEFT folders (adapter), held in host memory and device
slots (manager), applied to a batch that mixes adapters and the base model (layers)."""
