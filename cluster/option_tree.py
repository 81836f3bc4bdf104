"""How a tree of configuration dataclasses becomes user-facing options: every field a typed, checked
`Option`, and from those the YAML reader, the argparse flags and the JSON Schema.

`OptionTree.of(Root)` walks a root dataclass whose dataclass-typed fields are sections (one level
deep), its other fields top-level options. A field's metadata carries its help text and may name
its `flag`, `choices`, an `alias`, an `example` and whether it is a `size` (bytes, also written
with a unit); `internal` fields are no options. This module knows no section of Baton's:
`cluster.config` builds its tree (`BatonConfig`) with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SIZE_PATTERN", "Option", "OptionTree", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT]?[iI]?[bB]?)?\s*$"


def parse_size(value: str | int) -> int:
    """'1073741824', '2GB', '1.5GiB', '512MiB' -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value)) if isinstance(value, str) else None
    unit = (match.group(2) or "").lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit such as 512MiB or 2GB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Option:
    """One user-facing field of the tree."""

    path: tuple[str, ...]  # ("engine", "block_size"), or ("model",) at the top
    name: str  # flat name: the flag without dashes, the key of `BatonConfig.load(options=...)`
    type: type  # int, float, str or bool
    optional: bool  # None allowed
    default: Any
    help: str
    choices: tuple | None
    size: bool  # bytes, also written with a unit ("512MiB")
    example: Any  # a valid non-default value (tests use it)
    alias: str | None = None  # a short flag beside the long one, as vLLM's -tp
    multiple: bool = False  # a string flag taking several values (vLLM's --lora-modules), joined a line each

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def get(self, config: Any) -> Any:
        node: Any = config
        for part in self.path:
            node = getattr(node, part)
        return node

    def coerce(self, value: Any) -> Any:
        """Check a value read from YAML or given in Python; ValueError names the key."""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{self.key} must not be null")
        if self.size:
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{self.key}: {exc}") from None
        kind = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[self.type]
        if isinstance(value, bool) != (self.type is bool):
            raise ValueError(f"{self.key} must be {kind}, got {value!r}")
        if self.type is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, self.type):
            raise ValueError(f"{self.key} must be {kind}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(str(c) for c in self.choices if c is not None)
            raise ValueError(f"{self.key} must be one of {allowed}, got {value!r}")
        return value


def _base_type(annotation: Any) -> tuple[type, bool]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (base,) = [a for a in args if a is not type(None)]
        return base, type(None) in args
    return annotation, False


def _section_options(cls: type, prefix: tuple[str, ...]) -> list[Option]:
    hints = typing.get_type_hints(cls)
    options = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("internal") or dataclasses.is_dataclass(hints[f.name]):
            continue
        base, optional = _base_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name} is an option without a default")
        options.append(
            Option(
                path=prefix + (f.name,),
                name=meta.get("flag", f.name),
                type=base,
                optional=optional,
                default=default,
                help=meta.get("help", ""),
                choices=meta.get("choices"),
                size=bool(meta.get("size")),
                example=meta.get("example"),
                alias=meta.get("alias"),
                multiple=bool(meta.get("nargs", False)),
            )
        )
    return options


def _suggestion(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class _JoinLines(argparse.Action):
    """A flag's several values as one string, a value per line (the option's type is a string)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, "\n".join(values))


def _flag_parser(option: Option):
    def parse(text: str) -> Any:
        try:
            if option.size:
                return parse_size(text)
            return option.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} for {option.flag}") from None

    parse.__name__ = option.type.__name__
    return parse


@dataclass(frozen=True)
class OptionTree:
    """The options of one root dataclass, and what reads, builds and describes them."""

    root: type
    sections: dict[str, type]  # section name -> its dataclass
    options: list[Option]

    @classmethod
    def of(cls, root: type) -> OptionTree:
        hints = typing.get_type_hints(root)
        sections = {f.name: hints[f.name] for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])}
        options = _section_options(root, ()) + [
            option for name, section in sections.items() for option in _section_options(section, (name,))
        ]
        duplicates = {o.name for o in options if [p.name for p in options].count(o.name) > 1}
        assert not duplicates, f"options share a flag: {duplicates}"
        return cls(root, sections, options)

    def build(self, values: Mapping[tuple[str, ...], Any]) -> Any:
        """A root instance from checked values by path; each section validates itself."""
        top = {path[0]: v for path, v in values.items() if len(path) == 1}
        for name, cls in self.sections.items():
            kwargs = {path[1]: v for path, v in values.items() if len(path) == 2 and path[0] == name}
            try:
                top[name] = cls(**kwargs)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return self.root(**top)

    def read_options(self, options: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
        """Checked values by path from flat option names, as the flags spell them (port=8001)."""
        by_name = {o.name: o for o in self.options}
        values: dict[tuple[str, ...], Any] = {}
        for name, value in options.items():
            option = by_name.get(name.replace("-", "_"))
            if option is None:
                raise ValueError(f"unknown option {name!r}{_suggestion(name, by_name)}")
            values[option.path] = option.coerce(value)
        return values

    def read_yaml(self, config_file: str | os.PathLike) -> dict[tuple[str, ...], Any]:
        """Checked values by path from a YAML file nested as the tree is."""
        path = Path(config_file)
        if not path.is_file():
            raise ValueError(f"config file {str(config_file)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {str(config_file)!r} is not valid YAML: {exc}") from None
        if loaded is None:
            return {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(config_file)!r} must hold a mapping of option: value")
        by_path = {o.path: o for o in self.options}
        # Where each key could be meant to go: a flat flag name in the wrong place suggests its path.
        known = {o.key: o.key for o in self.options} | {o.name: o.key for o in self.options}
        known |= {s: s for s in self.sections}
        values: dict[tuple[str, ...], Any] = {}

        def unknown(key: str) -> ValueError:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {known[close[0]]!r}?" if close else ""
            return ValueError(f"unknown key {key!r} in {str(config_file)!r}{hint}")

        for raw_key, value in loaded.items():
            key = str(raw_key).replace("-", "_")
            if key in self.sections:
                if not isinstance(value, dict):
                    raise ValueError(f"{key} must be a mapping of option: value, got {value!r}")
                for raw_sub, sub_value in value.items():
                    sub = str(raw_sub).replace("-", "_")
                    option = by_path.get((key, sub))
                    if option is None:
                        raise unknown(f"{key}.{sub}")
                    values[option.path] = option.coerce(sub_value)
            elif (key,) in by_path:
                values[(key,)] = by_path[(key,)].coerce(value)
            else:
                raise unknown(key)
        return values

    def to_dict(self, config: Any) -> dict[str, Any]:
        """A root instance's values as the YAML file would spell them."""
        out: dict[str, Any] = {}
        for option in self.options:
            node = out
            for part in option.path[:-1]:
                node = node.setdefault(part, {})
            node[option.path[-1]] = option.get(config)
        return out

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """One flag per option; only flags given on the command line appear in the parsed namespace."""
        for option in self.options:
            help_text = f"{option.help} (default: {option.default})" if option.help else f"default: {option.default}"
            kwargs: dict[str, Any] = {"dest": option.name, "default": argparse.SUPPRESS, "help": help_text}
            if option.type is bool:
                parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, **kwargs)
                continue
            if option.choices is not None:
                kwargs["choices"] = [c for c in option.choices if c is not None]
            flags = (option.flag, option.alias) if option.alias else (option.flag,)
            if option.multiple:  # several values after the flag, kept as one string, a value per line
                parser.add_argument(*flags, nargs="+", action=_JoinLines, **kwargs)
                continue
            parser.add_argument(*flags, type=_flag_parser(option), **kwargs)

    def json_schema(self, title: str, description: str) -> dict[str, Any]:
        """A self-contained JSON Schema (draft-07) of the YAML file, every default and help text included."""

        def leaf(option: Option) -> dict[str, Any]:
            names = {int: "integer", float: "number", str: "string", bool: "boolean"}
            kinds = [names[option.type]] + (["string"] if option.size else []) + (["null"] if option.optional else [])
            entry: dict[str, Any] = {
                "type": kinds if len(kinds) > 1 else kinds[0],
                "default": option.default,
                "description": option.help,
            }
            if option.choices is not None:
                entry["enum"] = list(option.choices)
            if option.size:
                entry["pattern"] = SIZE_PATTERN
            return entry

        def node(properties: dict[str, Any], description: str) -> dict[str, Any]:
            return {
                "type": "object",
                "description": description,
                "additionalProperties": False,
                "properties": properties,
            }

        top = {o.path[0]: leaf(o) for o in self.options if len(o.path) == 1}
        for name, cls in self.sections.items():
            top[name] = node(
                {o.path[1]: leaf(o) for o in self.options if o.path[0] == name and len(o.path) == 2},
                (cls.__doc__ or name).strip().splitlines()[0],
            )
        schema = node(top, description)
        return {"$schema": "http://json-schema.org/draft-07/schema#", "title": title, **schema}
