"""`/metrics` of several router processes sharing a port: one exposition for all of them.

With `baton serve --api-server-count N` a scrape of the shared port reaches whichever router
process the kernel hands the connection to. So that every scrape sees the whole deployment, each
router labels its own series `router="<id>"` and leaves its exposition in a shared folder every
second (`RouterExposition.publish`); any router answers /metrics with its own series, fresh, and
those the others left there (at most a second old), merged per metric family. A router whose file
is older than `stale_after_s` is gone (killed, restarting under a new id): its series disappear,
as a dead pod's do. Per-router series rather than sums because a router's counters reset when it
restarts and Prometheus can only see that per series; `sum without (router) (rate(...))` gives the
deployment's totals. The worker series (`baton:num_requests_running{worker=...}` and the like)
are the same in every router's view, so they are taken from this router only.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["RouterExposition"]


class _Families:
    """A collector yielding fixed metric families (the merged view)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def describe(self):
        return []

    def collect(self):
        return iter(self.families)


class RouterExposition:
    """One router's part in the merged /metrics of a multi-router deployment."""

    def __init__(self, router_id: str, folder: str | os.PathLike, stale_after_s: float = 10.0) -> None:
        self.router_id = router_id
        self.folder = Path(folder)
        self.stale_after_s = stale_after_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = self.folder / f"{router_id}.prom"

    def _own(self, registry: CollectorRegistry) -> list[Metric]:
        """This router's families, every sample labelled with its id."""
        families = []
        for family in registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [type(s)(s.name, {**s.labels, "router": self.router_id}, *s[2:]) for s in family.samples]
            families.append(labelled)
        return families

    def publish(self, registry: CollectorRegistry) -> None:
        """Leave this router's exposition for the others (written whole, then renamed)."""
        text = generate_latest(_registry(self._own(registry)))
        tmp = self._file.with_suffix(".tmp")
        tmp.write_bytes(text)
        os.replace(tmp, self._file)

    async def publish_every(self, registry: CollectorRegistry, every_s: float = 1.0) -> None:
        while True:
            try:
                self.publish(registry)
            except OSError:
                pass  # the folder went away (shutdown): nothing to share any more
            await asyncio.sleep(every_s)

    def render(self, registry: CollectorRegistry) -> bytes:
        """This router's series and the other live routers', one family per metric name."""
        merged: dict[str, Metric] = {}
        order: list[str] = []

        def add(family: Metric, skip_workers: bool) -> None:
            # No *_created series: generate_latest writes them as families of their own, which the
            # parser then reads back as gauges that would clash with the counters they belong to.
            samples = [
                s
                for s in family.samples
                if not s.name.endswith("_created") and not (skip_workers and "worker" in s.labels)
            ]
            if family.name not in merged:
                if not samples:
                    return
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                order.append(family.name)
            merged[family.name].samples.extend(samples)

        for family in self._own(registry):
            add(family, skip_workers=False)
        now = time.time()
        for path in sorted(self.folder.glob("*.prom")):
            if path == self._file:
                continue
            try:
                if now - path.stat().st_mtime > self.stale_after_s:
                    continue
                text = path.read_text()
            except OSError:
                continue  # replaced or removed while we looked
            for family in text_string_to_metric_families(text):
                add(family, skip_workers=True)
        return generate_latest(_registry([merged[name] for name in order]))


def _registry(families: list[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return registry
