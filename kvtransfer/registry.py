"""KV transport backends by kind: the one table that `kvtransfer.create_transport` builds from and
that the pairwise transport builds its per-pair backends from (as vLLM's KV-connector factory).

The built-in backends are registered once, in kvtransfer/__init__.py; `common.transports.BACKENDS`
names the same kinds torch-free (tests/kvtransfer/test_registry.py checks they agree). Tests and
plug-ins may `register_transport()` a backend of their own at run time (`unregister_transport()` after).
"""

from __future__ import annotations

from typing import Any

from common.transports import Place

from .base import KVTransport

_TRANSPORTS: dict[str, type[KVTransport]] = {}


def register_transport(kind: str, cls: type[KVTransport], replace: bool = False) -> type[KVTransport]:
    """Register backend class `cls` as `kind` (its `KVTransport.kind`); ValueError when the kind is
    taken, unless `replace` (a plug-in or a test standing in for a built-in, in its place)."""
    if not (isinstance(cls, type) and issubclass(cls, KVTransport)):
        raise TypeError(f"a KV transport backend must subclass KVTransport, got {cls!r}")
    if cls.kind != kind:
        raise ValueError(f"KV transport class {cls.__name__} has kind {cls.kind!r}, registered as {kind!r}")
    if kind in _TRANSPORTS and not replace:
        raise ValueError(f"KV transport {kind!r} is registered already ({_TRANSPORTS[kind].__name__})")
    _TRANSPORTS[kind] = cls
    return cls


def unregister_transport(kind: str) -> None:
    """Remove a backend registered at run time (tests)."""
    del _TRANSPORTS[kind]


def transport_kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order."""
    return tuple(_TRANSPORTS)


def transport_class(kind: str) -> type[KVTransport]:
    """The backend class registered as `kind`; ValueError naming the registered ones."""
    cls = _TRANSPORTS.get(kind)
    if cls is None:
        raise ValueError(f"unknown KV transport {kind!r}; expected one of {transport_kinds()}")
    return cls


def create_transport(kind: str, **options: Any) -> KVTransport:
    """Build the backend `kind`. `options` go to its constructor, e.g. `host=` for gloo/nccl (address
    to bind and advertise), `fault=` for inprocess, `num_slots=` and `verify_chunk_bytes=` for shm,
    `choice=`, `place=` and `name=` for pairwise (the one serving workers use); every backend takes
    `checksums=` (seal what it sends, default on) and `fault_plan=` (a FaultPlan of faults to inject,
    tests: kvtransfer.integrity)."""
    return transport_class(kind)(**options)


def transport_for_place(kind: str, place: Place, checksums: bool = True) -> KVTransport:
    """The backend `kind` for a worker at `place` (the pairwise transport's per-pair backends)."""
    return transport_class(kind).for_place(place, checksums=checksums)
