"""Tests that run beside the rest of the session, in a second pytest process at idle CPU priority.

A full `make test` on this 2-core machine leaves a core idle for about a fifth of its core-seconds:
Ray and servers starting, clients waiting on sockets, deadlines running out. The tests listed in
`BESIDE` are pure computation in their own process (transformers' exactness, the engine on tiny
models, kernels in the interpreter, the simulator, accuracy statistics) with no deadline that a slow
core could miss. As collection ends, the session hands them to a child `pytest` at the lowest
priority (tests/idle_priority.py): it runs only on a core that would otherwise be idle, so the Ray,
fault and starvation tests beside it keep the cores they had. The session waits for the child at its
end, prints its report and fails if the child failed; the child fails if a test handed to it is not
among those it collects.

`BATON_TESTS_BESIDE=0` runs everything in the one process, as does a session whose tests are all on
one side. `--junitxml=X` gives the child's results in `X` with `.beside` before the suffix. A test
that reads the host's idle CPU time (marked `idle_host`) runs at the end, once the child has ended:
/proc/stat counts the child's time as busy whatever its priority.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ENABLE_ENV = "BATON_TESTS_BESIDE"
IDS_ENV = "BATON_TESTS_BESIDE_IDS"  # set in the child: the file of node ids it runs

# Node id prefixes. Not here: anything with Ray, a server, a socket or a wall-clock deadline, and
# tests/kernels/test_compile_targets.py, whose compile processes start with the session, beside
# it at the same priority, within a deadline of their own.
BESIDE = (
    "tests/engine/test_default_model_exact.py",
    "tests/engine/test_structured_engine.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_gemma_and_windows.py",
    "tests/engine/test_speculative_engine.py",
    "tests/engine/test_speculative_triton.py",
    "tests/engine/test_reasoning_grammar.py",
    "tests/engine/test_prefix_and_stress.py",
    "tests/engine/test_draft_model.py",
    "tests/engine/test_tiny_models_exact.py",
    "tests/engine/test_triton_path.py",
    "tests/unit/test_sampling_distribution.py",
    "tests/unit/test_cli_imports.py",
    "tests/sim/test_planner.py",
    "tests/sim/test_moe_costs.py",
    "tests/fp8/test_fp8_accuracy_fast.py",
    "tests/fp8/test_fp8_moe_gemma.py",
    "tests/kernels/test_fused_moe.py",
    "tests/kernels/test_kernel_attention.py",
    "tests/kernels/test_kernel_attention_window.py",
    "tests/kernels/test_kernel_fp8.py",
    "tests/kernels/test_kernel_kv_store.py",
    "tests/kernels/test_kernel_norm_act.py",
    "tests/kernels/test_kernel_rotary.py",
)


def runs_beside(nodeid: str) -> bool:
    return nodeid.startswith(BESIDE)


def _junit_beside(xmlpath: str) -> str:
    path = Path(xmlpath)
    return str(path.with_name(f"{path.stem}.beside{path.suffix}"))


class Beside:
    """The pytest plugin: splits the session's items (parent) or keeps only the handed ones (child)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.child: subprocess.Popen | None = None
        self.report: Path | None = None
        self.count = 0

    @pytest.hookimpl(tryfirst=True)  # before the conftest hooks that start background work for the items
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        ids_file = os.environ.get(IDS_ENV)
        if ids_file:  # the child: exactly the tests the parent handed over
            wanted = set(Path(ids_file).read_text().splitlines())
            session.items[:] = [item for item in session.items if item.nodeid in wanted]
            missing = wanted - {item.nodeid for item in session.items}
            if missing:  # a test id that differs between two collections would otherwise never run
                raise pytest.UsageError(f"tests handed over but not collected here: {sorted(missing)[:5]}")
            return
        if self.config.option.collectonly or os.environ.get(ENABLE_ENV, "1") == "0":
            return
        beside = [item for item in session.items if runs_beside(item.nodeid)]
        if not beside or len(beside) == len(session.items):
            return
        # Tests marked idle_host go last, and the child has ended before they start (below).
        kept = [item for item in session.items if not runs_beside(item.nodeid)]
        session.items[:] = [item for item in kept if not item.get_closest_marker("idle_host")] + [
            item for item in kept if item.get_closest_marker("idle_host")
        ]
        self._start(beside)

    def _start(self, items: list[pytest.Item]) -> None:
        from tests.idle_priority import popen_at_lowest_priority

        folder = Path(tempfile.mkdtemp(prefix="baton-tests-beside-"))
        ids = folder / "ids"
        ids.write_text("\n".join(item.nodeid for item in items))
        modules = sorted({item.nodeid.split("::", 1)[0] for item in items})
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:lfplugin", "-p", "no:nfplugin", *modules]
        if self.config.option.xmlpath:
            args.append(f"--junitxml={_junit_beside(self.config.option.xmlpath)}")
        self.report, self.count = folder / "report.txt", len(items)
        with self.report.open("w") as out:
            self.child = popen_at_lowest_priority(
                args,
                cwd=self.config.rootpath,
                env={**os.environ, IDS_ENV: str(ids)},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(
                f"{self.count} tests run beside the others at idle priority (tests/beside.py); "
                "their report follows at the end"
            )

    def _stop_child(self) -> None:
        """As Ctrl-C would: the child's session end stops its own background work; then SIGKILL."""
        try:
            os.killpg(self.child.pid, signal.SIGINT)
            self.child.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had ended

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.child is not None and item.get_closest_marker("idle_host"):
            self.child.wait()  # its CPU time, idle priority or not, counts as busy in /proc/stat

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.child is None:
            return
        if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop or session.shouldfail:
            self._stop_child()
        code = self.child.wait()
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.ensure_newline()
            terminal.write_sep("=", f"the {self.count} tests run beside (exit code {code})")
            terminal.write(self.report.read_text())
        os.unlink(self.report)
        os.unlink(self.report.with_name("ids"))
        os.rmdir(self.report.parent)
        if code != 0 and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
