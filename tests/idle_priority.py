"""The priority of the work a test session runs beside its tests: only CPU time nothing else wants.

SCHED_IDLE alone is not enough where the kernel groups tasks by session (autogroups,
`kernel.sched_autogroup_enabled`, on by default): the scheduler shares a core between sessions
first and between a session's tasks second, so a SCHED_IDLE process still takes its session's share
from processes in other sessions, and the simulated nodes of tests/cluster and `baton serve`
(testkit.harness) run in sessions of their own. `python -m tests.idle_priority` measures it: a
spinning process pinned to one core beside a spinning one at normal priority, over 4 s, took 0.02
CPU-seconds at SCHED_IDLE in the same session, 2.26 (a fair half) at SCHED_IDLE in a session of its
own, 0.07 the same with its session's autogroup at nice 19. So background work starts through
`popen_at_lowest_priority`: in a session of its own, with `lowest_priority` run in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def lowest_priority() -> None:
    """For a child process (preexec_fn): if it leads a session of its own, that session's autogroup
    at nice 19 (in any other session it would lower every process of the session); its own policy
    SCHED_IDLE (niceness 19 without SCHED_IDLE)."""
    if os.getsid(0) == os.getpid():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
        except OSError:
            pass  # no autogroups here: the policy alone
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def popen_at_lowest_priority(args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs) in a session of its own at the lowest priority."""
    return subprocess.Popen(args, start_new_session=True, preexec_fn=lowest_priority, **kwargs)


_SPIN = "import sys, time\nend = float(sys.argv[1])\nwhile time.time() < end:\n    pass\nprint(time.process_time())"


def sched_idle_only() -> None:
    """SCHED_IDLE without the autogroup's niceness (what `lowest_priority` adds to it), to measure against."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def cpu_beside_a_spinner(preexec, new_session: bool, seconds: float = 2.0) -> tuple[float, float]:
    """CPU seconds of two spinning processes pinned to one core for `seconds`: one at normal priority
    in this session, the other started with `preexec` (None: normal too), in a new session or not."""
    core = str(min(os.sched_getaffinity(0)))
    end = str(time.time() + seconds + 0.5)  # both spin until the same moment, whenever each started
    command = ["taskset", "-c", core, sys.executable, "-c", _SPIN, end]
    normal = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, start_new_session=new_session, preexec_fn=preexec
    )
    return float(normal.communicate()[0]), float(other.communicate()[0])


if __name__ == "__main__":  # the measurement docs/development.md quotes
    for what, preexec, new_session in (
        ("SCHED_IDLE, same session", sched_idle_only, False),
        ("SCHED_IDLE, a session of its own", sched_idle_only, True),
        ("lowest_priority, a session of its own", lowest_priority, True),
    ):
        mine, other = cpu_beside_a_spinner(preexec, new_session, 4.0)
        print(f"{what}: {other:.2f} CPU-seconds beside {mine:.2f} at normal priority")
