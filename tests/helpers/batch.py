"""Run many generated programs inside one torchrun launch (tests/helpers/verify_many.py uses it).

Starting processes costs more than training a small model (importing torch and the model's
libraries, seconds per process), so one launch of W processes runs a list of jobs: each job is a
train.py's main(argv) on `world` <= W ranks, in a process group of its own (gloo, rendezvous through
a file), and the ranks not in a job go on to their next one. Jobs are placed on contiguous rank
windows by a fixed greedy schedule every rank computes alike; each rank runs its jobs in list
order, so a job starts once all of its ranks are done with earlier jobs (no deadlock).

    python -m torch.distributed.run --standalone --nproc-per-node W tests/helpers/batch.py JOBS.json

Run as a script, it imports only torch and the standard library (its folder, not the tests', is on
sys.path); the programs it runs import autoplan from the installed package.

JOBS.json: {"store_dir": str, "timeout_s": float (collectives), "wait_s": float (ranks meeting),
"jobs": [{"dir", "argv", "world", "errors"}, ...]}; a job with "same_ranks_as": i runs on job i's
ranks after it (e.g. resuming its checkpoint); a job with "program": path runs that file's main(argv)
instead of <dir>/train.py's (a hand-written loop, e.g. examples/recipes/custom_loop.py); a job with
"reference": true is autoplan verify's single-device reference run of <dir>/train.py (autoplan.runtime.harness.reference,
its "gradients_out" the harness's --gradients-out), on one rank without a process group; a job with "env": {...}
runs with those environment variables set (e.g. autoplan verify's hook, AUTOPLAN_VERIFY).
A job that raises writes the traceback to <errors>.rank<r> and the rank goes on; a rank through a job (its
cleanup included) marks it in <errors>.done.rank<r>, so a launch that died tells which jobs it finished.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist


def placements(worlds: Sequence[int], slots: int, same_ranks_as: Sequence[int | None] = ()) -> list[int]:
    """First rank of each job: the window of ranks free earliest (a job costs one time unit), or
    the window of an earlier job it must follow (same_ranks_as[i]: that job's index)."""
    free_at = [0] * slots
    offsets: list[int] = []
    for index, world in enumerate(worlds):
        if not 1 <= world <= slots:
            raise ValueError(f"a job of {world} ranks does not fit in {slots}")
        follow = same_ranks_as[index] if index < len(same_ranks_as) else None
        if follow is not None:
            if not 0 <= follow < index or worlds[follow] != world:
                raise ValueError(f"job {index} cannot follow job {follow}")
            start = offsets[follow]
        else:
            start = min(range(slots - world + 1), key=lambda o: (max(free_at[o:o + world]), o))
        begin = max(free_at[start:start + world])
        free_at[start:start + world] = [begin + 1] * world
        offsets.append(start)
    return offsets


def _load_program(path: Path, index: int) -> Any:
    spec = importlib.util.spec_from_file_location(f"autoplan_batch_train_{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_job(index: int, job: dict, local_rank: int, store_dir: Path, timeout_s: float, wait_s: float) -> None:
    """Run one job on this rank. Its ranks may arrive far apart (each finishes its earlier jobs
    first): they meet in the store with the long `wait_s`, then collectives time out after `timeout_s`."""
    world = job["world"]
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    os.environ.update(job.get("env") or {})
    try:
        if job.get("reference"):  # autoplan verify's single-device reference: one process, no process group
            from autoplan.runtime.harness.reference import run_reference

            gradients_out = job.get("gradients_out")
            run_reference(Path(job["dir"]) / "train.py", job["argv"], Path(gradients_out) if gradients_out else None)
        else:
            store = dist.FileStore(str(store_dir / f"job{index}.store"), world)
            store.set_timeout(timedelta(seconds=wait_s))
            if store.add("arrived", 1) == world:
                store.set("all arrived", "1")
            store.wait(["all arrived"])
            dist.init_process_group("gloo", store=dist.PrefixStore("job", store), rank=local_rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
            program = Path(job.get("program") or Path(job["dir"]) / "train.py")
            _load_program(program, index).main(list(job["argv"]))
    except BaseException:  # noqa: BLE001 - every failure is reported per job; the rank goes on
        Path(f"{job['errors']}.rank{local_rank}").write_text(traceback.format_exc())
    finally:
        for name in job.get("env") or {}:
            os.environ.pop(name, None)
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_device_meshes()
        _forget_compiled_code()
        gc.collect()  # what the job left holding a process group goes now, not at interpreter exit
    Path(f"{job['errors']}.done.rank{local_rank}").touch()  # this rank is through the job, its cleanup included


def _forget_compiled_code() -> None:
    """Drop what torch.compile kept of a job (dynamo's guards and graphs, which hold the job's device meshes
    and process groups), as a new process would: a later job's compiled module must be traced afresh."""
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.reset()


def _forget_device_meshes() -> None:
    """Drop DTensor's sharding-propagation caches. They are keyed by equal-comparing DeviceMeshes and
    hand back the first job's mesh, whose process-group names a later job on the same ranks never
    registered ("Could not resolve the process group registered under the name 12")."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def main(argv: Sequence[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    rank, slots = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jobs = spec["jobs"]
    offsets = placements([job["world"] for job in jobs], slots, [job.get("same_ranks_as") for job in jobs])
    for index, (job, offset) in enumerate(zip(jobs, offsets)):
        if offset <= rank < offset + job["world"]:
            run_job(index, job, rank - offset, Path(spec["store_dir"]), spec["timeout_s"], spec["wait_s"])


if __name__ == "__main__":
    main(sys.argv[1:])
    # Leave without the interpreter's teardown: a gloo process group still referenced from a job's leftovers
    # (e.g. a collective's work object) and destroyed there can abort the process ("terminate called without an
    # active exception"; CI saw one rank of a tests/test_expert_parallel_program.py launch end with SIGABRT),
    # which torchrun reports as the whole launch failing although every job has written its results.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
