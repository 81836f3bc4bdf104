"""Worker actors undo Ray's niceness (workers.shell.actors.normal_priority) on every thread."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, threading
from workers.shell.actors import normal_priority
ready, done = threading.Event(), threading.Event()
def idle():
    ready.set()
    done.wait()
t = threading.Thread(target=idle); t.start(); ready.wait()
tids = [int(x) for x in os.listdir("/proc/self/task")]
for tid in tids:
    os.setpriority(os.PRIO_PROCESS, tid, 15)  # as Ray's raylet leaves a worker
assert all(os.getpriority(os.PRIO_PROCESS, tid) == 15 for tid in tids)
raised = normal_priority()
print(raised, [os.getpriority(os.PRIO_PROCESS, tid) for tid in tids])
later = threading.Thread(target=lambda: print("child", os.getpriority(os.PRIO_PROCESS, 0))); later.start(); later.join()
done.set(); t.join()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs CAP_SYS_NICE")
def test_every_thread_goes_back_to_niceness_zero():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split("\n")
    raised, after = out[0].split(" ", 1)
    assert int(raised) >= 2 and set(json.loads(after)) == {0}, out
    assert out[1] == "child 0"  # threads started afterwards inherit it
