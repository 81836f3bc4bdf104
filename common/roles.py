"""The two worker roles of disaggregated serving, defined once.

`Role` is a str enum: a member equals (and hashes like) its value, so YAML, JSON, Ray and
msgpack keep seeing "prefill" and "decode", and `str(role)` / f-strings print the value.
"""

from __future__ import annotations

import enum

__all__ = ["ROLES", "Role"]


class Role(str, enum.Enum):
    """A worker's role: PREFILL runs prompts and hands the KV over; DECODE generates the tokens."""

    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


# Every role, in the order pools are listed (prefill first).
ROLES: tuple[Role, ...] = tuple(Role)
