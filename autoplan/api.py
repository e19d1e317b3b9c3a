"""The public API: orchestrates capture -> profile -> search -> plan -> codegen -> reports.

This is the only module that writes an output folder. Everything goes into a hidden staging sibling
first; a new folder is that sibling renamed into place when complete. Re-planning into a folder replaces only
autoplan's own entries in it (those its OWN_FILES list names, and those it writes now) and keeps everything
else, a job's checkpoints, logs, TensorBoard runs, metrics, and says what it kept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplan.errors import UserError
from autoplan.hardware.types import Cluster, HardwareProfile
from autoplan.plan import ClusterRef, Compile, ModelRef, Plan, Training
from autoplan.profile_data import ModelProfile
from autoplan.solve.refusals import not_planned, pins_for_capture, pipeline_refusal
from autoplan.solve.scaling import SCALING_FACTORS, SCALING_LAYOUTS, ScalingPoint, scaling_curve  # noqa: F401

log = logging.getLogger("autoplan")

OWN_FILES = ".autoplan-files"
"""In every output folder: the names of the entries autoplan wrote there, one a line. Re-planning replaces
those and keeps the rest."""
_KEPT_SHOWN = 6
"""Kept entries named in the line that says what re-planning kept (the rest are counted)."""

DEFAULT_GPU = "h100-sxm5-80gb"
PROFILE_BATCH_SIZE = 2
"""Samples per captured/profiled batch. Costs scale linearly from it; 1 is avoided because export
may specialize a batch dimension of size 1."""
DEFAULT_BATCH_PER_GPU = 4
"""--global-batch defaults to this many samples per GPU."""

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> float:
    """"80GiB", "80 GB", "512MiB", "1.5e9" -> bytes. A bad value raises UserError."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise UserError(f"cannot read memory size {text!r}: write e.g. 80GiB, 40GB or 512MiB")
        value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UserError(f"memory size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class PlanResult:
    """Everything one planning run produced (the Plan plus the data behind the reports)."""

    plan: Plan
    profile: ModelProfile
    candidates: tuple[Any, ...]
    """autoplan.solve.search.Candidate for every layout tried."""
    scaling: tuple[ScalingPoint, ...] = ()
    """The best layout at N/8 .. 4N GPUs, same batch per GPU (scaling_curve)."""
    not_planned: tuple[str, ...] = ()
    """A line per dimension the model cannot take, naming the module and why (not_planned)."""
    parameter_server: Any = None
    """autoplan.solve.parameter_server.ParameterServerLayout: the same model under a parameter server and why
    it lost (candidates.csv and the report), or None (one GPU, or a batch that does not split over them)."""


def load_cluster(gpus: Any, gpu: str, gpus_per_node: Any, memory_per_gpu: Any, hardware: str | None,
                 host_memory_per_node: Any = None) -> Cluster:
    from autoplan.hardware.profiles import load_hardware

    errors = []
    num_gpus = _positive_int(gpus, "--gpus", errors)
    per_node = None if gpus_per_node is None else _positive_int(gpus_per_node, "--gpus-per-node", errors)
    cap = host = None
    if memory_per_gpu is not None:
        try:
            cap = parse_bytes(memory_per_gpu)
        except UserError as e:
            errors.append(str(e))
    if host_memory_per_node is not None:
        try:
            host = parse_bytes(host_memory_per_node)
        except UserError as e:
            errors.append(f"--host-memory-per-node: {e}")
    profile: HardwareProfile | None = None
    try:
        profile = load_hardware(hardware if hardware else gpu)
    except UserError as e:
        errors.append(str(e))
    if errors:
        raise UserError("; ".join(errors))
    per_node = per_node or min(profile.default_gpus_per_node, num_gpus)
    return Cluster(profile, num_gpus, per_node, cap, host)


def _positive_int(value: Any, flag: str, errors: list[str]) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number <= 0 or str(value).strip() != str(number):
        errors.append(f"{flag} must be a positive integer, got {value!r}")
        return 1
    return number


def _source(model: Any, example_batch: Any):
    from autoplan.contract import ModelSource, load_source

    if isinstance(model, (str, os.PathLike)):
        return load_source(str(model))
    if isinstance(model, ModelSource):
        return model
    if callable(model) and example_batch is not None:
        return ModelSource(Path("<python>"), "build_model", None, model, example_batch, None)
    raise UserError("model must be a path to model.py (optionally path.py:factory), or a factory plus example_batch=")


@dataclass(frozen=True)
class PlanOptions:
    """What a planning run is asked for beyond the model and the GPUs: the CLI's flags (autoplan.plan's keywords)."""

    gpus_per_node: int | None = None
    """GPUs per node (default: the hardware profile's node size)."""
    global_batch: int | None = None
    """Samples per optimizer step (default DEFAULT_BATCH_PER_GPU per GPU)."""
    dtype: str | None = None
    """"bf16" or "fp32" (default bf16 on GPUs, fp32 on cpu)."""
    memory_per_gpu: str | float | None = None
    """A cap on usable memory per GPU ("40GiB", or bytes)."""
    host_memory_per_node: str | float | None = None
    """Host memory per node for CPU offload (default: the hardware profile's)."""
    pin: str | None = None
    """Layout choices to fix, "tp=8,pp=4" (solve/pins.py)."""
    hardware: str | None = None
    """A hardware profile file (overrides the gpu name)."""
    solver: str = "highs"
    """The MILP solver, highs or cbc."""
    time_limit: float | None = None
    """The MILP's time limit, seconds."""
    example_batch: Any = None
    """With a model factory instead of a file: its example_batch(batch_size)."""
    out: str | os.PathLike | None = None
    """The output folder to write (None: plan only)."""
    measure: bool | None = None
    """Price with op times measured on this machine (default: for the cpu profile only); for a GPU profile it needs a
    CUDA GPU here, which stands for the planned one (ops timed in the plan's dtype)."""
    float8_linears: str | None = None
    """Price the Linears as float8 training runs them over bf16, by recipe ("torchao" or "transformer_engine",
    cost/float8.py). Priced only: the generated program cannot run float8, so no output folder is written with it."""
    ring_traced: bool = False
    """Price context parallelism's ring as traced into torch.compile graphs, every exchange waited where it is issued
    (cost/context_parallel.py), even on a layout priced eager: a published run's compiled blocks where the program
    cannot compile the layout (compile=on prices the program's own so). Priced only, like float8_linears."""


def plan_model(model: Any, gpus: int, gpu: str = DEFAULT_GPU, options: PlanOptions = PlanOptions()) -> PlanResult:
    """Plan a model for `gpus` accelerators of profile `gpu`; with options.out, also write the output folder."""
    from autoplan.layout import Layout
    from autoplan.profile import profile_model
    from autoplan.solve.alternatives import alternatives
    from autoplan.solve.pins import parse_pins
    from autoplan.solve.scaling import ScalingInBackground
    from autoplan.solve.search import SearchOptions, search, solver_warning

    gpus_per_node, global_batch, dtype = options.gpus_per_node, options.global_batch, options.dtype
    memory_per_gpu, host_memory_per_node, pin = options.memory_per_gpu, options.host_memory_per_node, options.pin
    hardware, solver, time_limit, out = options.hardware, options.solver, options.time_limit, options.out
    measure, float8_linears, ring_traced = options.measure, options.float8_linears, options.ring_traced
    started = time.perf_counter()
    errors = []
    cluster = None
    try:
        cluster = load_cluster(gpus, gpu, gpus_per_node, memory_per_gpu, hardware, host_memory_per_node)
    except UserError as e:
        errors.append(str(e))
    pins = None
    try:
        pins = parse_pins(pin or "")
    except UserError as e:
        errors.append(str(e))
    if dtype not in (None, "fp32", "bf16"):
        errors.append(f"--dtype must be bf16 or fp32, got {dtype!r}")
    if global_batch is not None:
        _positive_int(global_batch, "--global-batch", errors)
    if solver not in ("highs", "cbc"):
        errors.append(f"--solver must be highs or cbc, got {solver!r}")
    if time_limit is not None and not float(time_limit) > 0:
        errors.append(f"--time-limit must be positive seconds, got {time_limit!r}")
    if cluster is not None and pins is not None:
        errors += _pin_arithmetic(pins, cluster)
    if float8_linears:
        errors += _float8_problems(float8_linears, cluster, dtype, out, measure)
    if ring_traced and out is not None:
        errors.append("a traced ring is priced only (a published run's compiled blocks on a layout priced eager; "
                      "compile=on prices the program's own): no output folder is written with it")
    if errors:
        raise UserError("; ".join(errors))
    source = _source(model, options.example_batch)

    on_cpu = cluster.gpu.name == "cpu"
    dtype = dtype or ("fp32" if on_cpu else "bf16")
    batch = int(global_batch) if global_batch is not None else DEFAULT_BATCH_PER_GPU * cluster.num_gpus
    measure = _measure_here(on_cpu if measure is None else measure, cluster.gpu.name)

    log.info("capture + profile %s at batch %d on %s", source.spec, PROFILE_BATCH_SIZE, cluster.gpu.name)
    profile = profile_model(source, PROFILE_BATCH_SIZE, cluster.hardware, measure=measure, dtype=dtype)
    pins = pins_for_capture(pins, profile)
    training = Training(global_batch_size=batch, dtype=dtype, tokens_per_sample=profile.tokens_per_sample)
    unpinned = pins == pins_for_capture(Layout(), profile, warn=False)  # the curve's N point is then the plan's
    # the report's scaling curve searches its other GPU counts in a second process meanwhile (a second core)
    curve = ScalingInBackground(profile, cluster, training, not unpinned) if out is not None else None
    log.info("search %d GPUs, %d ops, %d parameters", cluster.num_gpus, len(profile.ops), profile.param_count)
    try:
        result = search(profile, cluster, training, pins, SearchOptions(solver=solver, time_limit_s=time_limit,
                                                                  float8_linears=float8_linears,
                                                                  ring_traced=ring_traced))
        best = result.best
        warning = solver_warning(result.solver, time_limit)
        if warning:
            log.warning("%s", warning)
        plan = Plan(
            model=ModelRef(path=str(source.path), factory=source.factory_name, param_count=profile.param_count),
            cluster=ClusterRef(cluster.gpu.name, cluster.num_gpus, cluster.gpus_per_node, cluster.usable_memory_bytes),
            training=training,
            parallelism=best.parallelism,
            stages=best.stages,
            predicted=best.predicted,
            solver=result.solver,
            alternatives=alternatives(result.candidates, best),
            tensor_parallel_plan=dict(best.tensor_parallel_plan),
            tensor_parallel_left_whole=result.context.facts.left_whole if best.tensor_parallel_plan else (),
            activation_checkpoint_modules=tuple(best.activation_checkpoint_modules),
            batch_norm_modules=result.context.batch_norm_modules,
            compile=Compile(enable=best.compile),
        )
        scaling = curve.points(best if unpinned else None, context=result.context) if curve is not None else ()
    finally:
        if curve is not None:
            curve.cancel()  # stops the second process unless its points were collected
    planned = PlanResult(plan, profile, tuple(result.candidates), scaling, not_planned(result.context),
                         result.parameter_server)
    said = pipeline_refusal(profile)  # warned when the pins were read (pins_for_capture)
    for line in planned.not_planned:
        if line != said:
            log.warning("planning with %s", line)
    log.info("planned in %.2f s", time.perf_counter() - started)
    if out is not None:
        log.info("writing %s", out)
        write_outputs(planned, Path(out), source.path)
    return planned


def _float8_problems(recipe: str, cluster: Cluster | None, dtype: str | None, out: Any,
                     measure: bool | None) -> list[str]:
    """Why float8 linears cannot be priced for this request ([] if they can): they are priced only (no program
    runs them, so no output folder), over bf16 training, on an accelerator whose profile has a float8 peak, from
    estimated (not measured) op times."""
    from autoplan.cost.float8 import FLOAT8_PEAK_KEY, FLOAT8_RECIPES

    problems = []
    if recipe not in FLOAT8_RECIPES:
        problems.append(f"float8_linears must be one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}")
    if out is not None:
        problems.append("float8 linears are priced only (the generated program cannot run float8): "
                        "no output folder is written with them")
    if dtype not in (None, "bf16"):
        problems.append(f"float8 linears are priced over bf16 training, not --dtype {dtype}")
    if measure:
        problems.append("float8 linears are priced from the roofline, not from op times measured here")
    if cluster is not None and FLOAT8_PEAK_KEY not in cluster.gpu.peak_flops:
        problems.append(f"hardware profile {cluster.gpu.name!r} has no float8 peak (gpu.peak_tflops.{FLOAT8_PEAK_KEY})")
    return problems


def _pin_arithmetic(pins, cluster: Cluster) -> list[str]:
    """Pins that cannot hold on this cluster whatever the model (layout.problems without the model's
    facts), found before the model is captured."""
    from autoplan.layout import Scope, problems

    return problems(pins, Scope(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node))


def write_outputs(result: PlanResult, out: Path, model_file: Path) -> None:
    """Write plan.json, CSVs, train.py and launchers into `out`, atomically."""
    from autoplan.codegen import write_program
    from autoplan.report.unsupported import FILE_NAME as UNSUPPORTED_FILE
    from autoplan.report.unsupported import unsupported_ops_text
    from autoplan.report.csv import write_csvs
    from autoplan.report.html import write_report
    from autoplan.report.trace import write_trace

    if not model_file.is_file():
        raise UserError("writing train.py needs the model as a file: pass a path to model.py")
    with _staged_folder(out) as staging:
        (staging / "plan.json").write_text(result.plan.to_json())
        write_csvs(result, staging)
        (staging / UNSUPPORTED_FILE).write_text(unsupported_ops_text(result.profile, result.not_planned))
        write_report(result, staging, scaling=list(result.scaling) or None)
        write_trace(result.plan, staging)
        write_program(result.plan, staging, model_file)


@contextmanager
def _staged_folder(out: Path):
    """Yield a hidden sibling of `out` to write into; it goes into `out` only when the block completes
    (_replace_folder). On any exception (KeyboardInterrupt and SIGTERM included) it is removed: never a
    half-written folder. What an autoplan killed outright (SIGKILL) left beside `out` is removed first."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-{os.getpid()}-", dir=out.parent))
    try:
        yield staging
        (staging / OWN_FILES).write_text("".join(f"{p.name}\n" for p in sorted(staging.iterdir())) + f"{OWN_FILES}\n")
        with _signals_deferred():
            _replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:staging|old)-(?P<pid>\d+)(?:-.*)?")
"""A staging folder (.<out>.staging-<pid>-<random>) or the replaced entries (.<out>.old-<pid>) of a run."""


def _remove_leftovers(out: Path) -> None:
    """Remove the staging and replaced folders of `out` whose autoplan process is gone (killed before it could
    clean up). They hold autoplan's own files only: a job's data never moves (_replace_folder)."""
    for path in out.parent.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if match and match["name"] == out.name and path.is_dir() and not _running(int(match["pid"])):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def _signals_deferred():
    """Hold SIGINT and SIGTERM back while the folder is swapped in (a few renames), then act on them: a
    Ctrl-C there would leave the folder half old, half new. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in caught[:1]:
            handler = previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def _replace_folder(staging: Path, out: Path) -> None:
    """Move the staged entries into `out`. A new `out` is the staging folder renamed. An existing one keeps every
    entry autoplan did not write (OWN_FILES, from its previous run, and the staged names): autoplan's previous
    entries move to a hidden .<out>.old-<pid> folder, which is then removed, and the new ones move in beside the
    job's data, which never moves; one line says what was kept."""
    if not out.exists():
        staging.rename(out)
        out.chmod(0o755)
        return
    staged = sorted(p.name for p in staging.iterdir())
    own = set(staged) | _own_files(out)
    kept = sorted(p for p in out.iterdir() if p.name not in own)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    old.mkdir()
    for name in sorted(own):
        if (out / name).exists() or (out / name).is_symlink():
            (out / name).rename(old / name)
    for name in (*(n for n in staged if n != OWN_FILES), OWN_FILES):  # the list last: it marks a complete swap
        (staging / name).rename(out / name)
    staging.rmdir()
    shutil.rmtree(old, ignore_errors=True)
    if kept:
        log.warning("kept %s from the previous run in %s", _kept_names(kept), out)


def _own_files(out: Path) -> set[str]:
    """The entries a previous autoplan wrote into `out` (none known without its OWN_FILES list)."""
    listed = out / OWN_FILES
    if not listed.is_file():
        return set()
    return {line.strip() for line in listed.read_text().splitlines()
            if line.strip() and "/" not in line and line.strip() not in (".", "..")}


def _kept_names(kept: list[Path]) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in kept]
    shown = ", ".join(names[:_KEPT_SHOWN])
    return shown if len(names) <= _KEPT_SHOWN else f"{shown} and {len(names) - _KEPT_SHOWN} more"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _measure_here(measure: bool, gpu_name: str) -> bool:
    """`measure`, if this machine can stand for `gpu_name` (the CPU for "cpu", a CUDA GPU for a GPU profile);
    a UserError when asked to measure a GPU here without one."""
    if measure and gpu_name != "cpu" and not _has_cuda():
        raise UserError(f"--measure times ops on this machine, which has no GPU to stand for {gpu_name}: "
                        f"use --gpu cpu, or run where the GPU is")
    return measure


@dataclass(frozen=True)
class ProfileOptions:
    """What a profiling run is asked for beyond the model and the hardware profile's name (autoplan.profile's
    keywords; PlanOptions's meanings)."""

    hardware: str | None = None
    measure: bool | None = None
    batch_size: int = PROFILE_BATCH_SIZE
    """Samples per captured batch."""
    dtype: str | None = None
    out: str | os.PathLike | None = None
    """The folder to write ops.csv, modules.csv and profile.json into (None: none)."""


def profile_only(model: Any, gpu: str = DEFAULT_GPU, options: ProfileOptions = ProfileOptions()) -> ModelProfile:
    """Capture and profile without planning; with options.out, write ops.csv, modules.csv, profile.json."""
    hardware, measure, batch_size, dtype, out = (options.hardware, options.measure, options.batch_size, options.dtype,
                                                 options.out)
    from autoplan.hardware.profiles import load_hardware
    from autoplan.profile import profile_model
    from autoplan.report.unsupported import FILE_NAME as UNSUPPORTED_FILE
    from autoplan.report.unsupported import unsupported_ops_text
    from autoplan.report.csv import modules_frame, ops_frame

    hw = load_hardware(hardware if hardware else gpu)
    source = _source(model, None)
    on_cpu = hw.gpu.name == "cpu"
    measure = _measure_here(on_cpu if measure is None else measure, hw.gpu.name)
    profile = profile_model(source, batch_size, hw, measure=measure, dtype=dtype or ("fp32" if on_cpu else "bf16"))
    if out is not None:
        with _staged_folder(Path(out)) as staging:
            ops = ops_frame(profile)
            ops.to_csv(staging / "ops.csv", index=False)
            modules_frame(profile, ops).to_csv(staging / "modules.csv", index=False)
            (staging / UNSUPPORTED_FILE).write_text(unsupported_ops_text(profile))
            (staging / "profile.json").write_text(profile.to_json())
    return profile
