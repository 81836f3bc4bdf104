"""The `baton` command line: `serve`, `config schema` and `config show`.

The flags of `serve` and `config show` come from the configuration tree (cluster.config).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import yaml

from cluster.config import BatonConfig, add_flags, json_schema
from cluster.launcher import serve

CONFIG_HELP = "YAML file nested as `baton config show` prints it (flags win over it)"


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="model folder or .gguf file (same as --model)")
    parser.add_argument("--config", help=CONFIG_HELP)
    add_flags(parser)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_arguments(sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API"))
    config = sub.add_parser("config", help="the configuration: its JSON Schema, or the effective values")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    config_sub.add_parser("schema", help="print the JSON Schema of the --config file")
    _add_config_arguments(config_sub.add_parser("show", help="print the effective configuration as YAML"))
    return parser


def _load(args: argparse.Namespace) -> BatonConfig:
    options: dict[str, Any] = {k: v for k, v in vars(args).items()
                               if k not in ("command", "config_command", "config", "model_arg")}
    if args.model_arg is not None:
        if "model" in options:
            raise ValueError("give the model once, as MODEL or --model")
        options["model"] = args.model_arg
    return BatonConfig.load(args.config, options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    name = "baton " + args.command + (f" {args.config_command}" if args.command == "config" else "")
    if args.command == "config" and args.config_command == "schema":
        print(json.dumps(json_schema(), indent=2))
        return 0
    try:
        config = _load(args)
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(config)
    except ValueError as exc:  # ModelNotFoundError, KV layout mismatches, bad settings
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
