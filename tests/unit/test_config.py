"""The one configuration tree: flags, YAML file and JSON Schema all come from the same fields.

The oracle for "same configuration" is the dataclass tree itself: a value set by a flag and the
same value set in a YAML file must build equal BatonConfig objects, and both must differ from
the defaults (so a flag that is silently ignored fails here).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jsonschema
import pytest
import yaml

from cluster.cli import _parser, main
from cluster.config import OPTIONS, BatonConfig, json_schema
from router.routing import RoutingConfig
from workers.config import EngineConfig


def example_value(option):
    """A valid value other than the default, for any option."""
    if option.example is not None:
        return option.example
    if option.choices is not None:
        return next(c for c in option.choices if c != option.default and c is not None)
    if option.type is bool:
        return not option.default
    if option.type is int:
        return option.default * 2 if option.default else 8  # stays a power of two for block_size
    if option.type is float:
        return option.default * 2 + 1 if option.default is not None else 0.5
    return f"example-{option.name}"


def flag_args(option, value) -> list[str]:
    if option.type is bool:
        return [option.flag if value else "--no-" + option.flag[2:]]
    return [option.flag, str(value)]


def yaml_file(tmp_path, option, value):
    tree: dict = {}
    node = tree
    for part in option.path[:-1]:
        node = node.setdefault(part, {})
    node[option.path[-1]] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def parse_flags(argv: list[str]) -> BatonConfig:
    args = vars(_parser().parse_args(["serve", *argv]))
    return BatonConfig.from_options(**{k: v for k, v in args.items() if k not in ("command", "config", "model_arg")})


def test_every_field_has_one_flag_and_one_schema_entry_with_its_default():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("internal")}
    routing_fields = {f.name for f in dataclasses.fields(RoutingConfig)}
    assert {o.path[1] for o in OPTIONS if o.path[0] == "engine"} == engine_fields
    assert {o.path[1] for o in OPTIONS if o.path[0] == "routing"} == routing_fields

    serve = next(a for a in _parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    flag_strings = [s for action in serve._actions for s in action.option_strings]
    schema = json_schema()
    defaults = BatonConfig()
    for option in OPTIONS:
        assert flag_strings.count(option.flag) == 1, option.flag
        node = schema
        for part in option.path:
            node = node["properties"][part]
        assert node["default"] == option.default == option.get(defaults), option.key
        assert node["description"], f"{option.key} has no help text"
    # Nothing else: the flags are the options, --config, --help and the --no- forms of booleans.
    expected = (
        {o.flag for o in OPTIONS}
        | {"--no-" + o.flag[2:] for o in OPTIONS if o.type is bool}
        | {o.alias for o in OPTIONS if o.alias}
    )
    assert set(flag_strings) - {"-h", "--help", "--config"} == expected
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.key)
def test_a_yaml_file_and_the_flag_give_the_same_configuration(option, tmp_path):
    value = example_value(option)
    from_flag = parse_flags(flag_args(option, value))
    from_yaml = BatonConfig.load(yaml_file(tmp_path, option, value))
    assert from_flag == from_yaml
    assert option.get(from_flag) == option.coerce(value) != option.default
    jsonschema.validate(from_yaml.to_dict(), json_schema())


def test_flags_win_over_the_file_and_the_file_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  port: 9001\nengine:\n  dtype: bfloat16\n  kv-cache-memory: 64MiB\n")
    config = BatonConfig.load(path, {"port": 9002})
    assert (config.server.port, config.engine.dtype, config.engine.kv_cache_memory) == (9002, "bfloat16", 64 << 20)
    assert config.engine.block_size == EngineConfig().block_size


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine:\n  blok_size: 32\n", "unknown key 'engine.blok_size'.*did you mean 'engine.block_size'"),
        ("block_size: 32\n", "unknown key 'block_size'.*did you mean 'engine.block_size'"),
        ("routing:\n  polcy: random\n", "did you mean 'routing.policy'"),
        ("engine:\n  dtype: float64\n", "engine.dtype must be one of float32, float16, bfloat16, got 'float64'"),
        ("server:\n  port: eighty\n", "server.port must be an integer, got 'eighty'"),
        ("server:\n  port: 70000\n", "server: port must be in 1..65535"),
        ("engine:\n  enable_prefix_caching: 1\n", "engine.enable_prefix_caching must be true or false"),
        ("engine:\n  kv_cache_memory: lots\n", "engine.kv_cache_memory: cannot read 'lots' as a size"),
        ("engine:\n  block_size: 24\n", "engine: block_size must be a power of two"),
        ("engine: 16\n", "engine must be a mapping"),
        ("placement:\n  decode_workers: 0\n", "placement: decode_workers must be >= 1"),
        ("- a list\n", "must hold a mapping"),
    ],
)
def test_unknown_keys_and_bad_values_name_the_field(text, message, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        BatonConfig.load(path)


def test_bad_flags_fail_with_a_message_not_a_trace(capsys, tmp_path):
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--dtype", "float64"])
    assert exit_info.value.code == 2 and "invalid choice: 'float64'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-memory", "lots"])
    assert "invalid value 'lots' for --kv-cache-memory" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "m1", "--model", "m2"]) == 2
    assert "give the model once" in capsys.readouterr().err


def test_config_show_prints_the_effective_configuration_that_reloads_to_itself(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  dtype: bfloat16\n")
    assert main(["config", "show", "--config", str(path), "--port", "9100", "--no-enable-prefix-caching"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["server"]["port"] == 9100 and shown["engine"]["dtype"] == "bfloat16"
    assert shown["engine"]["enable_prefix_caching"] is False
    reloaded = tmp_path / "shown.yaml"
    reloaded.write_text(yaml.safe_dump(shown))
    assert BatonConfig.load(reloaded) == BatonConfig.load(path, {"port": 9100, "enable_prefix_caching": False})


def test_config_schema_is_a_self_contained_json_schema_that_rejects_bad_values():
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "config", "schema"], capture_output=True, text=True, check=True
    ).stdout
    schema = json.loads(out)
    assert schema == json_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    assert "$ref" not in out  # a remote $ref breaks offline `helm lint`
    validator = jsonschema.Draft7Validator(schema)
    assert not list(validator.iter_errors(BatonConfig().to_dict()))
    assert not list(validator.iter_errors({"engine": {"kv_cache_memory": "512MiB"}}))
    for bad, where in (
        (({"engine": {"dtype": "float64"}}), "dtype"),
        ({"engine": {"blok_size": 3}}, "blok_size"),
        ({"server": {"port": "x"}}, "port"),
    ):
        errors = list(validator.iter_errors(bad))
        assert errors and any(where in (e.message + "/".join(map(str, e.path))) for e in errors), bad


def test_workers_get_the_engine_section_with_their_threads():
    config = BatonConfig.from_options(threads_per_worker=3, dtype="bfloat16", kernel_backend="reference")
    engine = config.worker_engine_config()
    assert (engine.num_threads, engine.dtype, engine.kernel_backend) == (3, "bfloat16", "reference")
    assert config.engine.num_threads is None  # the tree itself is unchanged
