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

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def cap_generation(case, max_tokens: int) -> None:
    """Keep generated requests cheap on a CPU: at most `max_tokens` new tokens (still valid values)."""
    body = case.body
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > max_tokens:
                body[name] = max_tokens
