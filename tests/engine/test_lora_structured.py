"""Structured output under a LoRA adapter on the default model: the grammar's bitmask applies to
the adapted logits, so every answer validates (oracle: jsonschema on the decoded text), and the
adapter changes what the model writes inside the schema."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jsonschema
import pytest
import torch

from common.request import RequestContext
from common.sampling_params import SamplingParams, StructuredOutput
from router.tokenizer import Tokenizer
from tests.engine.helpers import save_lora_adapter
from workers.build import load_engine
from workers.config import EngineConfig

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_json_schema_under_an_adapter_validates_and_differs_from_the_base(default_model_dir):
    import transformers

    root = Path(tempfile.mkdtemp(prefix="baton-lora-json-"))
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
        save_lora_adapter(hf, root / "geo", 8, 16, ["q_proj", "v_proj", "down_proj"], seed=3, std=0.05)
        del hf
        config = EngineConfig(kv_cache_memory=48 << 20, enable_lora=True, lora_modules=f"geo={root / 'geo'}")
        engine = load_engine(default_model_dir, config)
        tok = Tokenizer.from_model_dir(default_model_dir)
        prompt = tok.encode(
            tok.render_chat([{"role": "user", "content": "Name a large city and its population, as JSON."}]),
            add_special_tokens=False,
        )
        params = SamplingParams(
            max_tokens=64, temperature=0.0, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))
        )
        texts = {}
        for adapter in ("geo", None):
            rid = engine.add_request(prompt, params, context=RequestContext(f"r-{adapter}", adapter=adapter))
            text, reason = "", None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid:
                        text += out.text
                        reason = out.finish_reason or reason
            assert reason == "stop", (adapter, text)
            jsonschema.validate(json.loads(text), SCHEMA)
            texts[adapter] = text
        assert texts["geo"] != texts[None]
    finally:
        shutil.rmtree(root, ignore_errors=True)
