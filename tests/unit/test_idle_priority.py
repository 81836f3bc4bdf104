"""The test session's background work takes only CPU time nothing else wants (tests/idle_priority.py),
measured on this host's scheduler: two spinning processes pinned to one core."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.idle_priority import cpu_beside_a_spinner, lowest_priority

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/autogroup") or shutil.which("taskset") is None,
    reason="needs Linux autogroups and taskset",
)


def test_lowest_priority_in_a_session_of_its_own_takes_almost_nothing_from_a_busy_core():
    mine, other = cpu_beside_a_spinner(lowest_priority, new_session=True, seconds=1.5)
    assert other < 0.2 * mine, (mine, other)  # measured here: 0.07 against 4.43 over 4 s


def test_lowest_priority_leaves_the_session_it_was_started_in_as_it_was():
    with open("/proc/self/autogroup") as f:
        before = f.read()
    cpu_beside_a_spinner(lowest_priority, new_session=False, seconds=0.3)
    with open("/proc/self/autogroup") as f:
        after = f.read()
    if after != before:  # an autogroup at nice 19 would slow every later test of this session
        with open("/proc/self/autogroup", "w") as f:
            f.write(before.split()[-1])
    assert after == before
