"""The `baton` command line: `serve`, `router`, `scale`, `plan`, `env`, `config schema` and `config show`.

The flags of `serve` and `config show` come from the configuration tree (cluster.config).
`scale` talks to a running server's admin endpoint (router.admin; `baton serve --admin-endpoint`).
`router` joins a running `baton serve` from another machine or pod as one more router process
(cluster.router_procs; the Helm chart's separate router Deployment runs it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import urllib.error
import urllib.request
from typing import Any

import yaml

from cluster.config import BatonConfig, add_flags, json_schema
from cluster.launcher import serve
from cluster.plan_cli import add_plan_parser, run_plan
from cluster.router_main import join_spec, run_router
from common import envs
from router.config import ADMIN_TOKEN_ENV, ADMIN_TOKEN_HEADER, API_KEY_ENV
from workers.config import KERNEL_BACKENDS

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
    scale = sub.add_parser(
        "scale",
        help="resize the pools of a running server (without sizes: show them)",
        description="Start or drain workers of a running `baton serve --admin-endpoint` until "
        "each pool has the size given; removed workers finish or hand over their "
        "requests first.",
    )
    scale.add_argument("--prefill", type=int, metavar="N", help="prefill workers wanted (0: decode workers prefill)")
    scale.add_argument("--decode", type=int, metavar="M", help="decode workers wanted (at least 1)")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    scale.add_argument(
        "--admin-token",
        default=None,
        help=f"the server's admin token (default: the {ADMIN_TOKEN_ENV} environment variable)",
    )
    scale.add_argument("--api-key", default=None, help=f"an API key of the server (default: {API_KEY_ENV})")
    scale.add_argument(
        "--timeout", type=float, default=900.0, help="seconds to wait for the pools to reach their size (default: 900)"
    )
    router = sub.add_parser(
        "router",
        help="serve as one more router of a running `baton serve` (another pod)",
        description="Join the Ray cluster of a running `baton serve`, find its workers by name "
        "and serve the same API with a router process of its own: its own prefix "
        "index, long-polls and lease on every worker (see --router-lease), and its "
        "share of the admission limits.",
    )
    router.add_argument("--config", required=True, help="the YAML configuration of the running `baton serve`")
    router.add_argument("--address", default="auto", help="the Ray cluster (auto or HOST:PORT; default: auto)")
    router.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes in all, this one included: each admits its share of the limits",
    )
    router.add_argument(
        "--router-id",
        default=None,
        help="this router's name on the workers (default: router-<host>-<pid>); a restarted router must take a new one",
    )
    add_plan_parser(sub)
    env = sub.add_parser(
        "env",
        help="print this machine's environment for bug reports (as `vllm collect-env`)",
        description="Versions (Python, torch, triton, CUDA, driver), GPUs with their compute "
        "capability and memory, NCCL, which implementation each kernel op runs here "
        "and why, FP8 support, and with --address the Ray cluster's nodes and custom "
        "resources. Loads no model and never starts Ray.",
    )
    env.add_argument("--json", action="store_true", help="machine-readable JSON instead of text")
    env.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster to describe (auto or HOST:PORT; default: none is queried)",
    )
    env.add_argument(
        "--kernel-backend",
        default="auto",
        choices=KERNEL_BACKENDS,
        help="the kernel_backend whose op resolution to show (default: auto)",
    )
    return parser


def _env(args: argparse.Namespace) -> int:
    # Here, not at the top: the report loads torch and the kernels (triton), which no other command needs.
    from cluster.env_report import collect, format_text

    report = collect(address=args.address, kernel_backend=args.kernel_backend)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_text(report), end="\n" if args.json else "")
    return 0


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One admin request; RuntimeError with the server's own message when it refuses."""
    headers = {"content-type": "application/json"}
    token = args.admin_token or envs.admin_token()
    key = args.api_key or (envs.api_key() or "").split(",")[0].strip()
    if token:
        headers[ADMIN_TOKEN_HEADER] = token
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise RuntimeError(
                f"{args.url} has no admin endpoint (start it with `baton serve --admin-endpoint`)"
            ) from None
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise RuntimeError(f"{args.url} answered {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"cannot reach {args.url}: {getattr(exc, 'reason', exc)}") from None


def _scale(args: argparse.Namespace) -> int:
    try:
        if args.prefill is None and args.decode is None:
            pools = _admin_call(args, "GET", "/admin/pools")
            print(f"prefill {pools['prefill']}, decode {pools['decode']}")
            for w in pools["workers"]:
                state = "draining" if w["draining"] else "up" if w["alive"] else "down"
                print(f"  {w['worker_id']:<12} {state:<9} {w['in_flight']} requests")
            return 0
        body = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
        result = _admin_call(args, "POST", "/admin/scale", body)
    except RuntimeError as exc:
        print(f"baton scale: {exc}", file=sys.stderr)
        return 1
    before, after = result["before"], result["after"]
    print(
        f"prefill {before['prefill']} -> {after['prefill']}, decode {before['decode']} -> {after['decode']} "
        f"in {result['seconds']:.1f} s"
    )
    if result["added"]:
        print("  started: " + ", ".join(result["added"]))
    if result["removed"]:
        print("  removed: " + ", ".join(result["removed"]) + f" ({result['moved_requests']} requests moved)")
    return 0


def _router(args: argparse.Namespace) -> int:
    if args.routers < 1:
        print(f"baton router: --routers must be >= 1, got {args.routers}", file=sys.stderr)
        return 2
    try:
        spec = join_spec(args.config, args.address, args.routers)
    except ValueError as exc:
        print(f"baton router: {exc}", file=sys.stderr)
        return 2
    return run_router(spec, 0, args.router_id or f"router-{socket.gethostname()}-{os.getpid()}")


def _load(args: argparse.Namespace) -> BatonConfig:
    options: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k not in ("command", "config_command", "config", "model_arg")
    }
    if args.model_arg is not None:
        if "model" in options:
            raise ValueError("give the model once, as MODEL or --model")
        options["model"] = args.model_arg
    return BatonConfig.load(args.config, options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "scale":
        return _scale(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "env":
        return _env(args)
    if args.command == "router":
        return _router(args)
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
