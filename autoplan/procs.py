"""Stopping a launched torchrun and every rank below it, and a rank leaving cleanly.

torchrun starts each rank in a session of its own, so killing torchrun's process group leaves the ranks
running: find them through /proc and kill their groups too.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import subprocess
from pathlib import Path


def descendants(root: int) -> list[int]:
    """Process ids of all descendants of `root`, from /proc (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_process_tree(process: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Stop `process` (started with start_new_session=True) and all its descendants' process groups.
    With `grace_s` > 0, SIGTERM first so torchrun can stop its ranks, then SIGKILL what is left."""
    if process.poll() is not None:
        return
    tree = descendants(process.pid)
    if grace_s > 0:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace_s)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass
    groups = [process.pid]
    for pid in tree:
        try:
            groups.append(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for group in dict.fromkeys(groups):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    process.wait()


def running_ranks(root: int) -> list[int]:
    """torch.distributed ranks (their RANK environment variable) still running below `root`: on a
    timeout, the ranks that never finished."""
    ranks = set()
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK=") and entry[5:].isdigit():
                ranks.add(int(entry[5:]))
    return sorted(ranks)


def exit_skipping_teardown(code: int) -> None:
    """End this rank's process with `code` once its work is done and written, without the interpreter's teardown:
    a gloo process group still referenced from leftovers and destroyed there can abort the process ("terminate
    called without an active exception", SIGABRT), and torchrun then reports the whole run as failed. Seen on
    CPU/gloo with torch 2.13 in one rank of `autoplan calibrate`'s worker and of test scripts, after the group had
    been destroyed."""
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
