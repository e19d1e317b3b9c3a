"""Run a test's script on N gloo ranks under torchrun and check each rank printed that it matches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 600
EXIT_AFTER = Path(__file__).with_name("exit_after.py")
"""Runs each rank's script, then leaves without the interpreter's teardown (see there)."""


def assert_every_rank_matches(script: Path, ranks: int) -> None:
    """Run `script` on `ranks` CPU processes; it must exit 0 with each rank printing "matches"."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(ranks), str(EXIT_AFTER), str(script)], capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("matches") == ranks, run.stdout[-3000:]
