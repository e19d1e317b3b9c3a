"""What a generated train.py checks before it starts anything: that the plan.json beside it (or the one given with
--plan) is the plan it was generated from, and that it was launched as the plan needs (under torchrun, with the
plan's number of processes; CUDA GPUs for --device cuda).

A problem is one line on stderr ("train.py: error: ...", printed by local rank 0 only: every rank finds the same)
and exit code 2 (interface.MISMATCH_EXIT_CODE), before the process group, the model or any file is touched. Each
check is a function that returns the problem's text (None: no problem), so tests call them without a launch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, NoReturn

from autoplan.errors import UserError
from autoplan.runtime.distributed.config import ParallelConfig
from autoplan.runtime.interface import MISMATCH_EXIT_CODE

PLAN_FILE = "plan.json"
"""The plan's file name in an output folder, beside train.py."""
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in each process it starts and torch's env:// rendezvous reads."""


class ArgumentParser(argparse.ArgumentParser):
    """train.py's parser: a mistake in its arguments (an unknown flag, a bad value) is one line and exit code 2, not
    argparse's usage block (train.py's usage runs over a dozen lines, which hid the error under it)."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(MISMATCH_EXIT_CODE)


def plan_mismatch(fingerprint: str, config: ParallelConfig, plan_path: Path, given: bool) -> str | None:
    """Why train.py (PLAN_FINGERPRINT `fingerprint`, layout `config`) must not run beside `plan_path`, or None.
    A missing plan.json is fine unless it was `given` (--plan): a train.py may be copied on its own."""
    from autoplan.plan import load_plan  # torch-free; loading checks the schema and the layout's rules

    plan_path = Path(plan_path)
    if not plan_path.is_file():
        return f"--plan {plan_path}: no such file" if given else None
    try:
        plan = load_plan(plan_path)
    except UserError as e:
        return f"cannot check {plan_path}, the plan beside it: {e}"
    found = plan.fingerprint()
    if found == fingerprint:
        return None
    planned, running = plan.parallelism.world_size_arithmetic(), config.parallelism.world_size_arithmetic()
    layouts = (f"{plan_path.name} is for {planned}, train.py for {running}" if planned != running else
               "the same degrees, other training settings or modules")
    return (f"{plan_path} is not the plan this train.py was generated from (fingerprint {found}, train.py's "
            f"PLAN_FINGERPRINT {fingerprint}: {layouts}): run the train.py generated with that plan "
            f"(autoplan writes both into its --out folder), or plan again")


def launch_problem(config: ParallelConfig, env: Mapping[str, str], running_world: int | None = None) -> str | None:
    """Why this process was not launched as the plan needs, or None. `env`: the process's environment (torchrun's
    variables); `running_world`: the world size of a process group already started (a test harness), else None."""
    world = config.parallelism.world_size
    launched = running_world if running_world is not None else _int(env.get("WORLD_SIZE"))
    command = f"bash launch/torchrun.sh, or torchrun --standalone --nproc-per-node {world} train.py on one machine"
    if running_world is None and any(name not in env for name in TORCHRUN_ENV):
        missing = [name for name in TORCHRUN_ENV if name not in env]
        return (f"train.py runs the plan's {config.parallelism.world_size_arithmetic()} under torchrun, which sets "
                f"{', '.join(missing)}: launch it with {command} (autoplan verify DIR checks it on this "
                f"machine's CPU against the unsplit model)")
    if launched != world:
        return (f"{launched} processes were started (WORLD_SIZE={env.get('WORLD_SIZE', launched)}: torchrun's "
                f"--nnodes x --nproc-per-node), but the plan is for {config.parallelism.world_size_arithmetic()}: "
                f"launch it with {command}")
    return None


def device_problem(device: str, local_world: int | None) -> str | None:
    """Why --device `device` cannot run `local_world` processes on this node (torchrun's LOCAL_WORLD_SIZE), or None."""
    if device != "cuda":
        return None
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        return f"--device cuda, but torch {torch.__version__} sees no CUDA GPU on this machine: use --device cpu"
    if local_world is not None and local_world > have:
        return (f"{local_world} processes were started on this node (LOCAL_WORLD_SIZE), one per GPU, but it has "
                f"{have} CUDA GPU{'s' if have != 1 else ''}")
    return None


def check_start(program_file: str | Path, fingerprint: str, config: ParallelConfig, plan: Path | None,
                device: str) -> None:
    """train.py's start-up checks (plan_mismatch with `plan`, else the plan.json beside `program_file`;
    launch_problem; device_problem): return when all pass, else print the first problem as one line on stderr
    (local rank 0 only) and exit with MISMATCH_EXIT_CODE."""
    import torch.distributed as dist

    env = os.environ
    running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    plan_path = plan if plan is not None else Path(program_file).resolve().parent / PLAN_FILE
    problem = (plan_mismatch(fingerprint, config, plan_path, given=plan is not None)
               or launch_problem(config, env, running)
               or device_problem(device, _int(env.get("LOCAL_WORLD_SIZE"))))
    if problem is None:
        return
    if env.get("LOCAL_RANK", "0") == "0":
        print(f"{Path(program_file).name}: error: {problem}", file=sys.stderr, flush=True)
    raise SystemExit(MISMATCH_EXIT_CODE)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
