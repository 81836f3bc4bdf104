"""bench/structured.py's pure parts: its requests, its reply check, its `vllm bench serve` command
and how runs add up."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from bench.structured_load import (
    SCHEMAS,
    aggregate,
    bench_command,
    check_reply,
    matching_lengths,
    response_format,
    schema_requests,
)
from router.structured import check_json_schema


def test_requests_cycle_over_the_schemas_with_distinct_prompts():
    requests = schema_requests(200)
    assert [r.schema_name for r in requests[:5]] == list(SCHEMAS)
    assert {r.schema_name for r in requests} == set(SCHEMAS)
    assert len({r.prompt for r in requests}) == 200
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        assert json.loads(check_json_schema(schema, "s")) == schema
        assert response_format(name)["json_schema"]["schema"] is schema


def test_check_reply_names_what_is_wrong():
    schema = SCHEMAS["order"]
    assert check_reply('{"id": "ABC-1234", "status": "shipped", "total": 12.5}', schema) is None
    assert check_reply('{"id": "abc", "status": "shipped", "total": 1}', schema).startswith("invalid")
    assert check_reply('{"id": "ABC-1234", "status": "lost", "total": 1}', schema).startswith("invalid")
    assert check_reply('{"id": "ABC-1234", "status": "shipped", "total": 1001}', schema).startswith("invalid")
    assert check_reply('{"id": "ABC-1234"', schema).startswith("not JSON")


def test_the_command_constrains_only_the_schema_runs():
    free = bench_command("vllm", "http://h", "tok", 3, 40, 16, 128, Path("/tmp/x.json"), None)
    bound = bench_command("vllm", "http://h", "tok", 3, 40, 16, 128, Path("/tmp/x.json"), SCHEMAS["flag"])
    assert "--ignore-eos" in free and "--extra-body" not in free
    body = json.loads(bound[bound.index("--extra-body") + 1])
    assert (
        body == {"structured_outputs": {"json": SCHEMAS["flag"]}, "ignore_eos": False} and "--ignore-eos" not in bound
    )
    for command in (free, bound):
        assert command[command.index("--max-concurrency") + 1] == "16"
        assert command[command.index("--num-prompts") + 1] == "40"


def test_aggregate_is_tokens_over_summed_durations():
    runs = [
        {
            "completed": 4,
            "failed": 0,
            "total_output_tokens": 100,
            "duration": 2.0,
            "mean_ttft_ms": 10.0,
            "mean_tpot_ms": 50.0,
        },
        {
            "completed": 3,
            "failed": 1,
            "total_output_tokens": 50,
            "duration": 3.0,
            "mean_ttft_ms": 24.0,
            "mean_tpot_ms": 85.0,
        },
    ]
    # The means are weighted by completed requests: (4 * 10 + 3 * 24) / 7 = 16, (4 * 50 + 3 * 85) / 7 = 65.
    assert aggregate(runs) == {
        "completed": 7,
        "failed": 1,
        "output_tokens": 150,
        "seconds": 5.0,
        "output_tokens_per_s": 30.0,
        "mean_ttft_ms": 16.0,
        "mean_tpot_ms": 65.0,
    }
    assert aggregate([])["output_tokens_per_s"] is None


def test_trailing_text_is_named_unless_allowed():
    text = '{"ok": true, "code": 200}\nmore words'
    assert check_reply(text, SCHEMAS["flag"]).startswith("text after")
    assert check_reply(text, SCHEMAS["flag"], allow_trailing=True) is None


def test_unconstrained_lengths_match_the_constrained_spread():
    # lengths 10, 20, 30: mean 20, sample sd 10, so r = sqrt(3) * 10 / 20 = 0.866.
    assert matching_lengths([10, 20, 30]) == (20, 0.866)
    assert matching_lengths([25, 25, 25]) == (25, 0.0)
    assert matching_lengths([1, 200]) == (100, 0.95)  # capped: vLLM wants a ratio below 1
    assert matching_lengths([]) == (1, 0.0) and matching_lengths([7]) == (7, 0.0)
    command = bench_command("vllm", "http://127.0.0.1:1", "tok", 0, 40, 16, 20, Path("/tmp/x.json"), None, 0.866)
    assert json.loads(command[command.index("--random-range-ratio") + 1]) == {"input": 0.0, "output": 0.866}
    assert "--random-range-ratio" not in bench_command("vllm", "u", "t", 0, 4, 2, 20, Path("/tmp/x.json"), None)
