"""Stopping a launched process tree, and naming the ranks that were still running."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplan.procs import descendants, kill_process_tree, running_ranks

CHILD = "import time; time.sleep(60)"
PARENT = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}], "
          "start_new_session=True); time.sleep(60)")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_ranks_below_a_launcher_are_named_and_killed_with_their_own_sessions():
    launcher = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, "RANK": "3"},
                                start_new_session=True)
    deadline = time.monotonic() + 20
    while not descendants(launcher.pid):
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.1)
    (rank_pid,) = descendants(launcher.pid)
    assert running_ranks(launcher.pid) == [3]
    kill_process_tree(launcher)  # the rank is in a session of its own, like torchrun's ranks
    deadline = time.monotonic() + 5
    while alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launcher.poll() is not None and not alive(rank_pid)


def test_a_rank_leaving_without_teardown_keeps_its_output_and_exit_code():
    """exit_skipping_teardown (calibrate's worker ends with it): what the rank printed is flushed, the code is its."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "from autoplan.procs import exit_skipping_teardown\n"
                          "print('written', end='')\nexit_skipping_teardown(3)"], capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (3, "written")
