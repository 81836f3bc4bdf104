"""Tenants and their weights: who a request is billed to (`RequestContext.tenant`), and each
tenant's share of a pool while several are backlogged (`--tenant-weights name=weight,...`; a tenant
not named weighs 1). The router and the workers' schedulers read the same weights."""

from __future__ import annotations

import math
from collections.abc import Mapping

from common.request import DEFAULT_TENANT

__all__ = ["DEFAULT_TENANT", "FAIRNESS_HEADER", "MAX_TENANT_NAME", "parse_tenant_weights", "tenant_from_header"]

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"  # llm-d's name for the tenant a request belongs to
MAX_TENANT_NAME = 128


def parse_tenant_weights(text: str | None) -> dict[str, float]:
    """`name=weight,...` -> {name: weight}; ValueError naming the entry that is wrong."""
    weights: dict[str, float] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        name, sep, value = entry.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name or not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"tenant weights are name=weight with a weight > 0, got {entry.strip()!r}")
        if name in weights:
            raise ValueError(f"tenant {name!r} is weighted twice")
        weights[name] = weight
    return weights


def tenant_from_header(headers: Mapping[str, str]) -> str:
    """The tenant a request names in llm-d's fairness header, else the shared default tenant."""
    value = headers.get(FAIRNESS_HEADER)
    if value is None or not value.strip():
        return DEFAULT_TENANT
    value = value.strip()
    if len(value) > MAX_TENANT_NAME or not value.isprintable():
        raise ValueError(f"{FAIRNESS_HEADER} must be a printable name of at most {MAX_TENANT_NAME} characters")
    return value
