"""The schemathesis checks both schemathesis tests run: no 5xx, and every answer conforms to the
app's OpenAPI schema (status, content type, body, headers); schema-invalid requests are refused.

Requests are generated from the schema (positive and negative modes), a bounded number per
operation. Positive-data acceptance is not checked: the schema cannot express limits that depend
on the prompt's token count, the served model's name or the server's configuration, which the
router refuses with a documented 400.
"""

from __future__ import annotations

import schemathesis
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def cap_generation(case, max_tokens: int) -> None:
    """Keep generated requests cheap on a CPU: at most `max_tokens` new tokens. A missing limit
    would let a chat request generate up to the whole context, so one is set; values that are
    invalid on purpose (negative mode) are left alone."""
    body = case.body
    if not isinstance(body, dict) or not case.path.startswith("/v1/") or "completions" not in case.path:
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > max_tokens):
            body[name] = max_tokens
