"""A model folder's safetensors weights, read as (name, tensor) pairs."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


class SafetensorsCheckpoint:
    """A model folder's weights as (name, tensor) pairs, plus what the loader needs besides them:
    the folder (its tokenizer calibrates FP8 KV scales) and config.json's quantization_config."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = sorted(self.model_dir.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"no *.safetensors files in {model_dir}")
        config_file = self.model_dir / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.quantization_config: dict | None = config.get("quantization_config")

    def __iter__(self):
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)


def iter_safetensors(model_dir: Path) -> SafetensorsCheckpoint:
    return SafetensorsCheckpoint(model_dir)
