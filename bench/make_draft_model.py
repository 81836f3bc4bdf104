"""A draft model built from the default model, for `"method": "draft_model"`: its first N decoder layers,
its final norm and its (tied) embedding and lm_head, so the draft shares the tokenizer and reads the
same residual stream the target's later layers refine (an early exit, no training).

    .venv/bin/python -m bench.make_draft_model [--layers 4] [--out DIR]

Prints the folder (default ~/.cache/baton/models/<default model>-first-<N>-layers); an existing one
is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from workers.models.files import resolve_model_dir


def make_draft(layers: int, out: Path | None = None) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = Path(resolve_model_dir(quiet=True))
    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"--layers must be between 1 and {config['num_hidden_layers'] - 1}, got {layers}")
    out = out or source.parent / f"{source.name}-first-{layers}-layers"
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kept = {}
    with safe_open(source / "model.safetensors", "pt") as weights:
        for name in weights.keys():
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers:
                continue
            kept[name] = weights.get_tensor(name)
    save_file(kept, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for extra in source.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, tmp / extra.name)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(make_draft(args.layers, args.out))


if __name__ == "__main__":
    main()
