"""The KV transport registry (kvtransfer/registry.py): the one table `create_transport` and the pairwise
transport build from. It agrees with the torch-free names the configuration reads
(common.transports.BACKENDS), refuses an unknown kind naming the registered ones, and a backend
registered here (removed after) is built by both factories."""

from __future__ import annotations

import pytest

import kvtransfer
from common import transports
from common.transports import Place
from kvtransfer import InProcessTransport, PairwiseTransport, ShmTransport, create_transport
from kvtransfer.registry import (
    register_transport,
    transport_class,
    transport_for_place,
    transport_kinds,
    unregister_transport,
)


def test_the_registry_and_the_torch_free_names_agree():
    assert transport_kinds() == transports.BACKENDS
    for kind in transport_kinds():
        assert transport_class(kind).kind == kind
    assert set(transports.FIXED_CHOICES) <= set(transport_kinds())  # every forced choice has a backend


def test_an_unknown_kind_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="unknown KV transport 'pigeon'") as e:
        create_transport("pigeon")
    assert all(kind in str(e.value) for kind in transports.BACKENDS)
    with pytest.raises(ValueError, match="registered already"):
        register_transport("shm", ShmTransport)
    with pytest.raises(ValueError, match="has kind 'inprocess'"):
        register_transport("other", InProcessTransport)


def test_a_backend_for_a_place_binds_the_places_host():
    hosts = []

    class Probe(kvtransfer.GlooTransport):
        def __init__(self, host: str = "127.0.0.1", **options) -> None:
            hosts.append(host)
            super().__init__(host, **options)

    place = Place("node-a", "10.1.2.3")
    Probe.for_place(place, checksums=False).close()  # what transport_for_place calls (nothing bound yet)
    assert hosts == ["10.1.2.3"]
    shm = transport_for_place("shm", place, checksums=False)
    assert type(shm) is ShmTransport
    shm.close()


class ToyTransport(InProcessTransport):
    """A backend of its own kind (the in-process protocol underneath)."""

    kind = "toy"


def test_a_registered_backend_is_built_by_create_transport():
    register_transport("toy", ToyTransport)
    try:
        assert "toy" in transport_kinds()
        transport = create_transport("toy", fault="fail")
        assert type(transport) is ToyTransport and transport.kind == "toy"
        transport.close()
    finally:
        unregister_transport("toy")
    assert "toy" not in transport_kinds()
    with pytest.raises(ValueError, match="unknown KV transport 'toy'"):
        create_transport("toy")


class CountingShm(ShmTransport):
    built = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        type(self).built += 1


def test_the_pairwise_transport_builds_its_backends_from_the_registry():
    register_transport("shm", CountingShm, replace=True)
    try:
        pairwise = create_transport("pairwise", choice="shm", place=Place(), name="w")
        assert isinstance(pairwise, PairwiseTransport) and pairwise.kinds == ("shm",)
        assert CountingShm.built == 1
        pairwise.close()
    finally:
        register_transport("shm", ShmTransport, replace=True)
    assert transport_class("shm") is ShmTransport and transport_kinds() == transports.BACKENDS
