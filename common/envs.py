"""Every environment variable Baton's product code reads (or sets), declared once with its
default and what it means, as vLLM's `envs.py` does.

Product modules read them only through the accessors below, never through `os.environ`
directly; each accessor reads the environment when called (not at import), so a variable set
by a test or a launcher before the call is seen. An empty value counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BATON_ADMIN_TOKEN",
    "BATON_API_KEY",
    "BATON_CACHE_DIR",
    "BATON_ALLOW_RUNTIME_LORA_UPDATING",
    "BATON_STEP_LOG_DIR",
    "CXX",
    "ENV_VARS",
    "EnvVar",
    "HF_HOME",
    "HF_HUB_CACHE",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "TRITON_INTERPRET",
    "admin_token",
    "api_key",
    "cache_dir",
    "cxx",
    "ensure_private_ray_env",
    "hf_hub_cache",
    "step_log_dir",
    "triton_interpret",
]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, its default (None: no default) and a one-line doc."""

    name: str
    default: str | None
    doc: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value in `environ` (default: the process's), or the default when unset or empty."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value else self.default

    def value(self, environ: Mapping[str, str] | None = None) -> str:
        """`get` of a variable that has a default, so never None."""
        value = self.get(environ)
        assert value is not None, f"{self.name} has no default"
        return value


def _home(*parts: str) -> str:
    return str(Path("~", *parts))


BATON_CACHE_DIR = EnvVar(
    "BATON_CACHE_DIR",
    _home(".cache", "baton"),
    "Baton's cache: imported GGUF models (models/) and compiled CPU kernels (kernels/)",
)
BATON_API_KEY = EnvVar(
    "BATON_API_KEY", None, "the router's API keys, comma-separated, when --api-key is not given (no key: no auth)"
)
BATON_ADMIN_TOKEN = EnvVar(
    "BATON_ADMIN_TOKEN", None, "the admin endpoint's token when --admin-token is not given (none: loopback only)"
)
BATON_ALLOW_RUNTIME_LORA_UPDATING = EnvVar(
    "BATON_ALLOW_RUNTIME_LORA_UPDATING",
    None,
    "1 or true: POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
)
BATON_STEP_LOG_DIR = EnvVar(
    "BATON_STEP_LOG_DIR",
    None,
    "a folder where every worker appends each engine step's shape and time to <worker>.jsonl",
)
HF_HUB_CACHE = EnvVar("HF_HUB_CACHE", None, "Hugging Face's hub cache folder (wins over HF_HOME)")
HF_HOME = EnvVar("HF_HOME", _home(".cache", "huggingface"), "Hugging Face's home; the hub cache is HF_HOME/hub")
CXX = EnvVar("CXX", "c++", "the C++ compiler that builds the native CPU kernels (else g++, else clang++)")
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", "0", "1/true/on/yes: run Triton kernels in Triton's interpreter")
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER = EnvVar(
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "0",
    "set (not read) by Baton before Ray starts: 0 makes a private Ray bind and talk to 127.0.0.1 only",
)
RAY_WORKER_NICENESS = EnvVar(
    "RAY_worker_niceness",
    "0",
    "set (not read) by Baton before Ray starts: 0 starts Ray's worker processes at normal priority, not Ray's 15",
)

ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        BATON_CACHE_DIR,
        BATON_API_KEY,
        BATON_ADMIN_TOKEN,
        BATON_ALLOW_RUNTIME_LORA_UPDATING,
        BATON_STEP_LOG_DIR,
        HF_HUB_CACHE,
        HF_HOME,
        CXX,
        TRITON_INTERPRET,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER,
        RAY_WORKER_NICENESS,
    )
}


def cache_dir() -> Path:
    """Baton's cache folder ($BATON_CACHE_DIR, default ~/.cache/baton)."""
    return Path(BATON_CACHE_DIR.value()).expanduser()


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """$BATON_API_KEY as written (comma-separated keys), or None when unset or blank."""
    value = BATON_API_KEY.get(environ)
    return value if value and value.strip() else None


def admin_token(environ: Mapping[str, str] | None = None) -> str | None:
    """$BATON_ADMIN_TOKEN without surrounding blanks, or None when unset or blank."""
    value = (BATON_ADMIN_TOKEN.get(environ) or "").strip()
    return value or None


def step_log_dir() -> str | None:
    """$BATON_STEP_LOG_DIR, or None: no step log."""
    return BATON_STEP_LOG_DIR.get()


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded repos on this node: $HF_HUB_CACHE, else $HF_HOME/hub."""
    hub = HF_HUB_CACHE.get()
    if hub:
        return Path(hub).expanduser()
    return Path(HF_HOME.value()).expanduser() / "hub"


def cxx() -> str:
    """The C++ compiler's name or path ($CXX, default c++)."""
    return CXX.value()


def triton_interpret() -> bool:
    """Whether Triton kernels run in Triton's interpreter ($TRITON_INTERPRET)."""
    return TRITON_INTERPRET.value().lower() in ("1", "true", "on", "yes")


def ensure_private_ray_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Before Ray starts (or is imported, for a driver): a private Ray then binds to and talks to
    127.0.0.1 only, not the machine's interface address, and starts its worker processes at
    niceness 0 rather than 15 (a worker booting at 15 beside busy workers at 0 barely runs; the
    actors also lower their own niceness, workers.shell.actors.normal_priority). Keeps a value the user
    set; `environ` (default: the process's) may be a child process's environment."""
    target = os.environ if environ is None else environ
    for var in (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, RAY_WORKER_NICENESS):
        target.setdefault(var.name, var.value({}))
