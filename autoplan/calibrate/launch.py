"""`autoplan calibrate --out PROFILE.yaml`: run the calibration worker on K ranks of this machine.

Run plainly, it launches itself under torchrun (python -m torch.distributed.run --standalone) in a
session of its own with a time limit, and reads back the profile rank 0 wrote. Run under torchrun
(WORLD_SIZE set, e.g. across nodes: torchrun --nnodes 2 ... -m autoplan calibrate --out P.yaml), it
is the worker itself, and rank 0 writes --out on its node.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware
from autoplan.hardware.types import HardwareProfile
from autoplan.procs import kill_process_tree

log = logging.getLogger("autoplan")

STDERR_TAIL_LINES = 25
CPU_DEFAULT_NPROC = 2
"""Ranks on the CPU when --nproc is not given: enough to time every link operation. On a GPU machine, one rank
per GPU: on a one-GPU machine one rank, which measures the device alone (its profile keeps the base profile's
links, calibrate/worker.py ONE_RANK)."""
KILL_GRACE_S = 5.0
"""After SIGTERM, torchrun gets this long to stop its ranks before they are killed."""


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_nproc(base: str | None) -> int:
    """Every GPU of this machine, or CPU_DEFAULT_NPROC ranks on the CPU (no GPU, or --gpu cpu)."""
    import torch

    on_cpu = not _has_gpu() or (base is not None and load_hardware(base).gpu.name == "cpu")
    return CPU_DEFAULT_NPROC if on_cpu else torch.cuda.device_count()


def _check_out(out: Path) -> None:
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"--out {out} must name a .yaml file (the hardware profile to write)")
    if out.exists() and out.is_dir():
        raise UserError(f"--out {out} is a folder: name the .yaml file to write")


def calibrate(out: str | os.PathLike, nproc: int | None = None, base: str | None = None,
              timeout_s: float = 600.0) -> HardwareProfile | None:
    """Measure this machine and write a hardware profile to `out`; returns it (None on ranks other
    than 0 when already running under torchrun). `base` (profile name or YAML) supplies datasheet
    peaks on GPUs; default: the packaged profile matching the device."""
    out = Path(out).resolve()
    _check_out(out)
    if base is not None:  # a bad name or file is the user's error: say so before launching anything
        if load_hardware(base).gpu.name != "cpu" and not _has_gpu():
            raise UserError(f"--gpu/--hardware {base} describes a GPU, but this machine has none: calibrate "
                            f"measures the device it runs on (drop the option, or use --gpu cpu)")
    if not timeout_s > 0:
        raise UserError(f"--timeout must be positive seconds, got {timeout_s!r}")
    if "WORLD_SIZE" in os.environ:
        if nproc is not None and nproc != int(os.environ["WORLD_SIZE"]):
            raise UserError(f"--nproc {nproc} disagrees with torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']}: drop --nproc")
        from autoplan.calibrate.worker import run

        run(out, base, timeout_s)
        return load_hardware(str(out)) if os.environ.get("RANK") == "0" else None
    nproc = _default_nproc(base) if nproc is None else nproc
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UserError(f"--nproc must be an integer >= 1 (1 rank measures the device alone; links need 2 or "
                        f"more), got {nproc!r}")
    _warn_if_busy()
    _launch(out, nproc, base, timeout_s)
    return load_hardware(str(out))


def _warn_if_busy() -> None:
    """Other work on the machine slows every measurement: say so rather than write a quietly bad profile."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if load > cores:
        log.warning("load average %.1f on %d cores: other processes will slow the measurements; "
                    "calibrate on an idle machine for a profile that plans well", load, cores)


def _launch(out: Path, nproc: int, base: str | None, timeout_s: float) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "autoplan.calibrate.worker", "--out", str(out), "--timeout", str(timeout_s)]
    if base is not None:
        command += ["--base", base]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=stderr, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_tree(process, KILL_GRACE_S)
            raise UserError(f"calibrate on {nproc} ranks did not finish within {timeout_s:g} s and was killed "
                            f"(raise --timeout); last lines of its stderr:\n{_tail(stderr)}") from None
        except BaseException:
            kill_process_tree(process, KILL_GRACE_S)
            raise
        if code != 0:
            raise UserError(f"calibrate on {nproc} ranks failed (exit code {code}); "
                            f"last lines of its stderr:\n{_tail(stderr)}")
    if not out.is_file():
        raise UserError(f"calibrate finished but wrote no {out}")


def _tail(stderr) -> str:
    """Our own error line if a rank printed one; else the traceback of the rank that failed first
    (torchrun prefixes rank output with "[rankN]:"; a rank whose peer died fails with a connection
    error, so a rank with any other error is the cause); else the last lines."""
    stderr.seek(0)
    lines = stderr.read().decode(errors="replace").splitlines()
    ours = list(dict.fromkeys(line for line in lines if line.startswith("autoplan: error:")))
    if ours:
        return "\n".join(ours)
    by_rank: dict[str, list[str]] = {}
    for line in lines:
        match = re.match(r"\[rank(\d+)\]:(.*)", line)
        if match:
            by_rank.setdefault(match.group(1), []).append(match.group(2))
    causes = [rank for rank, text in by_rank.items() if "Connection" not in text[-1]]
    if causes or by_rank:
        rank = (causes or list(by_rank))[0]
        return "\n".join(f"[rank{rank}]:{line}" for line in by_rank[rank][-STDERR_TAIL_LINES:])
    return "\n".join(lines[-STDERR_TAIL_LINES:]) or "(no output on stderr)"
