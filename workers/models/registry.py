"""The model registry: every supported family, listed once, and the lookups everything else uses.

Torch-free: the families' descriptors (`workers.models.family.ModelFamily`) come from the modules of
`workers/models/families/`, listed in `FAMILY_MODULES` below; a family's torch class is named
("module:Class") and imported only by `model_class()`, as vLLM's model registry does, so the `baton`
CLI and driver list and check architectures without loading torch.

Adding a family: a module under workers/models/families/ declaring `FAMILIES` (its class may be an
existing one or a new module of workers/models/), and one entry in FAMILY_MODULES. Tests and plug-ins
may also `register_family()` at run time (and `unregister_family()` after).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from workers.models.families import gemma, llama, moe
from workers.models.family import ModelFamily

# The one list: the order is the supported list's order in messages and the docs.
FAMILY_MODULES = (llama, moe, gemma)

_FAMILIES: dict[str, ModelFamily] = {}  # family name -> family
_BY_ARCH: dict[str, ModelFamily] = {}  # architecture -> its family


class UnsupportedArchitecture(ValueError):
    """config.json names no architecture of a registered family."""


def register_family(family: ModelFamily) -> ModelFamily:
    """Add `family`; ValueError when its name or one of its architectures is taken already."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered already")
    taken = [a for a in family.architectures if a in _BY_ARCH]
    if taken:
        raise ValueError(f"architectures {taken} already belong to {_BY_ARCH[taken[0]].name!r}")
    _FAMILIES[family.name] = family
    _BY_ARCH.update(dict.fromkeys(family.architectures, family))
    return family


def unregister_family(name: str) -> None:
    """Remove a family registered at run time (tests)."""
    family = _FAMILIES.pop(name)
    for arch in family.architectures:
        _BY_ARCH.pop(arch, None)


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES.values())


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCH)


def supported_list() -> str:
    """The supported architectures as messages name them."""
    return ", ".join(_BY_ARCH)


def family_for(architecture: str) -> ModelFamily:
    """The family serving `architecture`; UnsupportedArchitecture listing the supported ones."""
    family = _BY_ARCH.get(architecture)
    if family is None:
        raise UnsupportedArchitecture(f"architecture {architecture!r} not supported; Baton supports {supported_list()}")
    return family


def find_architecture(architectures: list[str] | tuple[str, ...]) -> str | None:
    """The first of config.json's `architectures` a registered family serves, or None."""
    return next((a for a in architectures if a in _BY_ARCH), None)


def model_class(architecture: str) -> type:
    """The torch class that runs `architecture` (imports its module: torch)."""
    module, _, name = family_for(architecture).model_class.partition(":")
    return getattr(importlib.import_module(module), name)


class _ModelClasses(Mapping):
    """architecture -> model class, read live from the registry (each class imported when looked up)."""

    def __getitem__(self, architecture: str) -> type:
        if architecture not in _BY_ARCH:
            raise KeyError(architecture)
        return model_class(architecture)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_BY_ARCH))

    def __len__(self) -> int:
        return len(_BY_ARCH)


MODEL_CLASSES: Mapping[str, type] = _ModelClasses()

for _family in (family for module in FAMILY_MODULES for family in module.FAMILIES):
    register_family(_family)
