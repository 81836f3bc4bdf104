"""The `baton` CLI starts without the engine's libraries: `baton --help`, `config` and `plan`, and
the `baton serve` driver's module graph (the process that starts Ray and runs the router), load
neither torch nor transformers, xgrammar or triton. Only the worker actors' own processes do
(workers.shell.actors imports the engine in the actor's constructor), and `baton env`, which reports them.

Each check runs in a fresh interpreter and reads its sys.modules afterwards.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "xgrammar", "triton"}


def modules_after(code: str) -> set[str]:
    """The top-level names in sys.modules once `code` has run in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint('\\nMODULES ' + json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("MODULES "))
    return {name.split(".")[0] for name in json.loads(line.removeprefix("MODULES "))}


def cli_run(*argvs: list[str]) -> str:
    """`baton ARGV` for each ARGV in turn, through the console script's entry point (exit codes ignored)."""
    return "".join(
        f"from cluster.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" for argv in argvs
    )


@pytest.mark.slow  # imports torch in a child process: about 3 s here
def test_the_check_sees_torch_where_it_is_loaded():
    # The oracle for the checks below: a module that does import torch is caught.
    assert "torch" in modules_after("import cluster.env_report")


def test_importing_the_cli_loads_no_engine_library():
    assert not HEAVY & modules_after("import cluster.cli")


def test_baton_help_config_and_plan_load_no_engine_library(tmp_path):
    workload = tmp_path / "w.yaml"
    workload.write_text("rate: 0.5\nduration_s: 10\nprompt_len: 128\noutput_len: 16\n")
    # One interpreter runs them all: none may load any of them.
    loaded = modules_after(
        cli_run(
            ["--help"],
            ["serve", "--help"],
            ["config", "schema"],
            ["config", "show", "--prefill-workers", "2"],
            [
                "plan",
                "--gpus",
                "2",
                "--model-profile",
                "roofline:B300:llama-8b",
                "--slo-ttft",
                "1s",
                "--slo-tpot",
                "50ms",
                "--workload",
                str(workload),
            ],
        )
    )
    assert "cluster" in loaded and not HEAVY & loaded


def test_the_serve_drivers_modules_load_no_engine_library():
    # What the driver runs: the launcher, the pool manager (workers added later), the extra
    # routers' entry point, and the actor classes it hands to Ray (decorated without a Ray).
    code = (
        "import cluster.launcher, cluster.pool_manager, cluster.router_main\n"
        "from cluster.config import BatonConfig\n"
        "from cluster.placement import resolve_pool, worker_config\n"
        "from workers.shell.actors import actor_class\n"
        "config = BatonConfig.load(None, {})\n"
        "for role in ('prefill', 'decode'):\n"
        "    actor_class(role)\n"
        "    worker_config(config, role, role + '-0', resolve_pool(config, role, []))\n"
    )
    loaded = modules_after(code)
    assert "ray" in loaded and "fastapi" in loaded  # it did load the driver's own libraries
    assert not HEAVY & loaded


@pytest.mark.slow  # a worker and a grammar in a child process: about 4 s here
def test_a_worker_loads_xgrammar_and_transformers_only_for_a_structured_request():
    # A worker's start imports the engine and builds it; xgrammar (which imports transformers,
    # about a second of CPU) waits for the first structured request. One interpreter checks both
    # sides: before the first grammar, neither is loaded (else the script fails); after, both are.
    code = (
        "import sys\n"
        "import workers.shell.worker, workers.engine.llm_engine, workers.engine.sampler, workers.engine.grammar\n"
        "early = {'xgrammar', 'transformers', 'torch'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert early == {'torch'}, early\n"
        "workers.engine.grammar._xgrammar()\n"
    )
    assert {"torch", "xgrammar", "transformers"} <= modules_after(code)


@pytest.mark.slow  # imports torch in a child process: about 5 s here
def test_baton_env_still_reports_torch():
    assert "torch" in modules_after(cli_run(["env", "--json"]))


def remote_methods(cls: type) -> dict[str, list[tuple[str, object, object]]]:
    """Public methods of `cls` (those Ray makes remote) -> their parameters (name, kind, default).
    Without `_ray_trace_ctx`: once a class was handed to ray.remote in this process (another test),
    Ray's tracing hook has added that keyword to its methods in place."""
    return {
        name: [
            (p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "_ray_trace_ctx"
        ]
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def test_the_rank_actor_offers_every_rank_call_with_its_signature():
    from workers.parallel.rank import TPRankWorker
    from workers.shell.actors import TPRankActor

    expected = remote_methods(TPRankWorker)
    assert {"send", "expect", "wait", "wait_stopped"} <= set(expected)
    assert remote_methods(TPRankActor) == expected
