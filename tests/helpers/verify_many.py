"""autoplan.verify's parity check (losses and first-step gradients) for several output folders in ONE
torchrun launch (tests/helpers/batch.py): process start-up, not training, dominates a small model's check,
so the folders' programs and references share the processes. Loading plans, comparing losses and
gradients and running subprocesses are autoplan.verify's own.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from autoplan.codegen.program import MODEL_COPY_DIR
from autoplan.errors import UserError
from autoplan.plan import Plan
from autoplan.runtime.harness.hooks import verify_environment
from autoplan.verify import (Runs, VerifyResult, VerifySettings, _compare, _load_plan, _measured, _Run, _run_all,
                             compare_gradients, run_args)

BATCH_SCRIPT = Path(__file__).with_name("batch.py")
"""The batch runner, launched by path (tests/ is not a package on the children's sys.path)."""


@dataclass(frozen=True)
class BatchJob:
    """One train.py run inside a shared launch (see tests/helpers/batch.py)."""

    out_dir: Path
    """The folder whose train.py runs."""
    argv: tuple[str, ...]
    """Its command-line arguments."""
    world: int
    """Ranks it needs (1 for a reference)."""
    same_ranks_as: int | None = None
    """Index of an earlier job to run after, on the same ranks (e.g. to resume its checkpoint)."""
    program: Path | None = None
    """The program whose main(argv) runs (default: out_dir's train.py)."""
    reference: bool = False
    """autoplan verify's single-device reference run of out_dir's train.py (autoplan.runtime.harness.reference) instead."""
    gradients_out: Path | None = None
    """Where the run writes its first-step gradients: a reference as the harness's --gradients-out, any other run
    through autoplan verify's hook (AUTOPLAN_VERIFY, which also turns its dropout off)."""


LAUNCH_ATTEMPTS = 2
"""Launches per run_batch: a launch whose rank died outside every job's Python code (a native abort or a kill, no
traceback; CI saw one rank of a 4-process context-parallel launch end so, once in three whole-suite runs) is
followed by one fresh launch of the jobs it did not finish; the first failure is reported as a warning naming
them, a second one as the error. A launch killed for running past its time is not repeated."""


def run_batch(jobs: list[BatchJob], nproc: int | None = None, timeout_s: float = 600,
              job_timeout_s: float = 120) -> list[str]:
    """Run the jobs in one torchrun launch of nproc (default: the largest job) CPU processes, all
    within timeout_s seconds; a job's collectives time out after job_timeout_s seconds (a failed rank
    leaves its partners waiting). Returns per job "" or the first failing rank's traceback."""
    nproc = nproc or max(job.world for job in jobs)
    with tempfile.TemporaryDirectory(prefix="autoplan-batch-") as tmp:
        tmp = Path(tmp)
        pending = list(range(len(jobs)))
        for attempt in range(1, LAUNCH_ATTEMPTS + 1):
            run = _launch(jobs, pending, nproc, tmp, tmp / f"launch{attempt}", job_timeout_s, timeout_s)
            if run is None:
                break
            failure, code = run
            unfinished = [i for i in pending if not _finished(tmp, i, jobs[i].world)]
            if code is None or code <= 0 or (unfinished and attempt == LAUNCH_ATTEMPTS):
                raise failure
            warnings.warn(f"{failure}\n(launch {attempt} of {LAUNCH_ATTEMPTS}; jobs it did not finish, rerun in a "
                          f"fresh launch: {', '.join(_describe(jobs[i]) for i in unfinished) or 'none'})")
            for i in unfinished:
                for leftover in tmp.glob(f"job{i}.error.*"):
                    leftover.unlink()
            pending = unfinished
            if not pending:
                break
        return [_first_error(tmp, i) for i in range(len(jobs))]


def _launch(jobs: list[BatchJob], indices: list[int], nproc: int, tmp: Path, launch_dir: Path,
            job_timeout_s: float, timeout_s: float) -> tuple[UserError, int | None] | None:
    """One torchrun launch of jobs[indices] (each job's error and done files keep its index in `jobs`); None
    if it exited cleanly, else its error and torchrun's exit code (None or negative: killed)."""
    launch_dir.mkdir()
    position = {index: p for p, index in enumerate(indices)}
    spec = {"store_dir": str(launch_dir), "timeout_s": job_timeout_s, "wait_s": timeout_s, "jobs": [
        {"dir": str(Path(jobs[i].out_dir).resolve()), "argv": list(jobs[i].argv), "world": jobs[i].world,
         "errors": str(tmp / f"job{i}.error"), "same_ranks_as": position.get(jobs[i].same_ranks_as),
         "program": str(Path(jobs[i].program).resolve()) if jobs[i].program else None,
         "reference": jobs[i].reference, **_gradients(jobs[i])}
        for i in indices]}
    (launch_dir / "jobs.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(BATCH_SCRIPT), str(launch_dir / "jobs.json")]
    run = _Run(f"batch run ({nproc} processes)", command, launch_dir, launch_dir)
    try:
        _run_all([run], timeout_s, sequential=True)
    except UserError as failure:
        return failure, run.process.poll()
    return None


def _gradients(job: BatchJob) -> dict:
    """A job's gradient output in the batch runner's terms: the reference's "gradients_out", else the "env" of
    autoplan verify's hook."""
    if job.gradients_out is None:
        return {}
    if job.reference:
        return {"gradients_out": str(job.gradients_out)}
    return {"env": verify_environment(job.gradients_out)}


def _finished(tmp: Path, index: int, world: int) -> bool:
    """Whether every rank of job `index` got through it (tests/helpers/batch.py marks each)."""
    return all((tmp / f"job{index}.error.done.rank{rank}").exists() for rank in range(world))


def _describe(job: BatchJob) -> str:
    return f"{Path(job.out_dir).name} {' '.join(job.argv[:2])}... on {job.world} rank{'s' if job.world > 1 else ''}"


def _first_error(tmp: Path, index: int) -> str:
    """The lowest failing rank's traceback for job `index`, or ""."""
    failed = sorted(tmp.glob(f"job{index}.error.rank*"))  # not the .error.done.rank* marks
    return failed[0].read_text() if failed else ""


@dataclass(frozen=True)
class VerifyBatch:
    results: list[VerifyResult]
    """One per folder, in order."""
    extra_errors: list[str]
    """One per extra job: "" or the first failing rank's traceback."""


def verify_many(out_dirs: list[Path | str], steps: int = 3, timeout_s: float = 600, nproc: int | None = None,
                extra_jobs: Sequence[BatchJob] = (), measure: bool = False) -> VerifyBatch:
    """autoplan.verify.verify() for several folders in one torchrun launch, within timeout_s seconds;
    each folder gets its verify.json. Folders whose reference runs would be identical (same model
    file, training settings and data-parallel degree) share one. `extra_jobs` (e.g. checkpoint and
    resume runs) share the launch too; they run after the verification jobs. `measure`: as verify --measure,
    each folder's run also writes its metrics (step times, peak memory and its parts) into verify.json; the
    step times then share the processes with other jobs (memory is counted per job, time is not comparable)."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    out_dirs = [Path(d) for d in out_dirs]
    plans = [_load_plan(d) for d in out_dirs]
    with tempfile.TemporaryDirectory(prefix="autoplan-verify-") as tmp:
        jobs, reference_of = _verification_jobs(out_dirs, plans, steps, Path(tmp), measure)
        offset = len(jobs)
        jobs += [replace(job, same_ranks_as=None if job.same_ranks_as is None else job.same_ranks_as + offset)
                 for job in extra_jobs]
        errors = run_batch(jobs, nproc, timeout_s)
        error_of = {str(job.argv[-1]): error for job, error in zip(jobs, errors)}
        results = []
        for i, (out_dir, plan) in enumerate(zip(out_dirs, plans)):
            losses_path = Path(tmp) / f"losses{i}.json"
            error = error_of[str(reference_of[i])] or error_of[str(losses_path)]
            reference = _read_list(reference_of[i]) if not error else []
            losses = _read_list(losses_path) if not error else []
            if not error and (len(reference) != steps or len(losses) != steps):
                error = f"expected {steps} losses, got {len(reference)} (reference) and {len(losses)}"
            world = plan.parallelism.world_size
            gradients = None if error else compare_gradients(_gradients_dir(reference_of[i]),
                                                             _gradients_dir(losses_path), world)
            metrics = Path(tmp) / f"metrics{i}.json"
            measured = _measured(plan, json.loads(metrics.read_text())) if measure and not error else {}
            results.append(_compare(out_dir, VerifySettings(world, steps),
                                    Runs(reference, losses, measured, error, gradients=gradients)))
        return VerifyBatch(results, errors[offset:])


def _verification_jobs(out_dirs: list[Path], plans: list[Plan], steps: int, tmp: Path,
                       measure: bool = False) -> tuple[list[BatchJob], list[Path]]:
    """The distributed run of each folder (writing tmp/losses<i>.json, and with `measure` tmp/metrics<i>.json),
    largest first, then the reference runs they need; and per folder, the file its reference writes its losses
    to."""
    common = run_args(steps)  # the same runs as autoplan verify's, dropout disabled on both sides
    references: dict[tuple, Path] = {}
    reference_jobs, reference_of = [], []
    for out_dir, plan in zip(out_dirs, plans):
        key = (_model_code(out_dir), plan.model.factory, json.dumps(plan.to_dict()["training"]),
               plan.parallelism.dp)
        if key not in references:
            references[key] = tmp / f"reference{len(references)}.json"
            reference_jobs.append(BatchJob(out_dir, (*common, "--losses-out", str(references[key])), 1,
                                           reference=True, gradients_out=_gradients_dir(references[key])))
        reference_of.append(references[key])
    metrics = (lambda i: ("--metrics-out", str(tmp / f"metrics{i}.json"))) if measure else (lambda i: ())
    runs = [BatchJob(out_dir, (*common, *metrics(i), "--losses-out", str(tmp / f"losses{i}.json")),
                     plan.parallelism.world_size, gradients_out=_gradients_dir(tmp / f"losses{i}.json"))
            for i, (out_dir, plan) in enumerate(zip(out_dirs, plans))]
    # the largest jobs first: the one-rank references then fill the gaps
    return sorted(runs, key=lambda job: -job.world) + reference_jobs, reference_of


def _model_code(out_dir: Path) -> tuple[tuple[str, bytes], ...]:
    """What the folder's program trains: its model_code/ files by path and contents, and which one it loads."""
    files = sorted(p for p in (out_dir / MODEL_COPY_DIR).rglob("*.py"))
    loads = next((line for line in (out_dir / "train.py").read_text().splitlines() if line.startswith("MODEL_FILE")),
                 "")
    return ((loads, b""), *((str(p.relative_to(out_dir)), p.read_bytes()) for p in files))


def _gradients_dir(losses_path: Path) -> Path:
    """Where the run that writes its losses to `losses_path` writes its first-step gradients."""
    return losses_path.with_name(losses_path.stem + "_gradients")


def _read_list(path: Path) -> list[float]:
    """The losses a run wrote to `path`, or [] if it wrote none."""
    try:
        return [float(x) for x in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []
