"""schemathesis against the router app over a FakeBackend, in process (ASGI): no 5xx, and every
answer conforms to the app's OpenAPI schema. tests/hardening/test_schemathesis.py runs the same
checks against a real deployment over HTTP."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from router.app import build_app
from router.config import ServerConfig
from router.tokenizer import Tokenizer
from testkit.backend import FakeBackend
from tests.hardening.schemathesis_run import CHECKS, MODES, cap_generation
from tests.router.conftest import MODEL_NAME
from workers.models.files import resolve_model_dir

KEY = "schemathesis-key"
MAX_EXAMPLES = 60  # per operation and mode: bounded, about 10 s in all


def _app():
    tokenizer = Tokenizer.from_model_dir(resolve_model_dir(None, quiet=True))
    return build_app(FakeBackend(tokenizer), tokenizer, MODEL_NAME, 2048, server=ServerConfig(api_key=KEY))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())
schema.config.generation.update(modes=MODES)


@schema.parametrize()
# derandomize: the same examples on every run, so CI and a developer see the same result.
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_answers_conform_to_the_schema(case):
    cap_generation(case, 256)
    case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS)
