"""`autoplan verify DIR`: run a generated program on CPU/gloo and check loss parity.

Two runs of DIR/train.py, each in its own process group (session) with a time limit:
  reference    python -m autoplan.runtime.harness.reference train.py -- ...   the unsplit model on the whole global batch
  distributed  python -m torch.distributed.run ... train.py ...      the planned layout on K CPU processes (gloo)
The distributed run is train.py as a user runs it, with AUTOPLAN_VERIFY set: runtime/harness/hooks.py's VerifyChecks at the
loop's one hook. The reference is runtime/harness/reference.py's, which imports that train.py and trains with its constants,
flags, model and schedule. Both start from the same weights, draw the same batches and use the same optimizer, so
their per-step losses agree to float rounding (|diff| <= PARITY_TOLERANCE) when the program is right.
Both run with every dropout the identity (runtime/distributed/dropout.py NoDropout): the ranks would draw other
random numbers than the reference. The reference counts the dropout calls it disabled; verify.json's
"dropout" says how dropout was handled.

The losses cannot show a gradient summed or averaged with a wrong factor: AdamW's update is (nearly)
invariant to a parameter's gradient scale (every expert gradient halved trained to the same losses within
1.4e-6), and to gradient clipping's global scale. So both runs clip below any gradient norm
(--clip-grad-norm VERIFY_CLIP_GRAD_NORM: the clipping always acts) and write, after the first step's backward and
clipping (the hook's gradients_out, the harness's --gradients-out; runtime/distributed/gradients.py),
every parameter's gradient as a full tensor by the model's name, each rank its own file, and every gradient
every rank reports is compared with the reference's: max |grad - reference| / max |reference| per parameter
(at least GRADIENT_FLOOR of the model's largest gradient entry in the denominator: some gradients are zero but
for rounding), the largest of them <= GRADIENT_TOLERANCE (verify.json "gradient_max_rel_diff", the parameter
and rank in "gradient_worst"). A parameter of the model no rank reports, or a name the model does not have,
fails the check ("gradient_problem").
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoplan.errors import UserError
from autoplan.plan import Plan, load_plan
from autoplan.procs import kill_process_tree, running_ranks

PARITY_TOLERANCE = 1e-4
"""Largest per-step |loss difference| accepted in fp32 (docs/verify.md)."""
GRADIENT_TOLERANCE = 1e-3
"""Largest relative difference of a parameter's first-step gradient accepted (see GRADIENT_FLOOR). fp32 on CPU
measures up to ~3e-6 (the sums run in other orders on the ranks); a gradient off by a factor (summed over 2
ranks instead of averaged, halved) is off by 0.5 or more, so 1e-3 is far from both."""
GRADIENT_FLOOR = 1e-3
"""A parameter's difference is taken relative to max(max |reference|, GRADIENT_FLOOR x the largest |gradient|
entry of the whole reference model). Some gradients are zero in exact arithmetic and rounding noise in fp32
(the bias of an attention key projection: softmax ignores a constant added to every key), e.g. 6e-14 in
deberta-v2 against a largest entry of 0.17: relative to itself that noise differs by 100% between two runs.
Rounding noise stays below ~1e-7 of the largest entry, 1e-4 of the floor; a factor-2 error is still caught
on every parameter whose gradient exceeds 2e-6 of the largest."""
STDERR_TAIL_LINES = 25


@dataclass(frozen=True)
class VerifySettings:
    """How verify runs a generated program (`autoplan verify`'s options)."""

    nproc: int | None = None
    """Processes (None: the plan's world size; it must be)."""
    steps: int = 3
    """Optimizer steps each run makes."""
    timeout_s: float = 300
    """Wall-clock limit of the runs, after which they are killed with their ranks."""
    measure: bool = False
    """Also measure step time and peak memory beside the prediction."""
    model_file: str = "copy"
    """Which model file train.py runs (MODEL_FILES)."""
    device: str = "cpu"
    """Where the program runs (DEVICES): "cpu" checks parity, "cuda" measures only."""


@dataclass(frozen=True)
class Runs:
    """What the two runs of a parity check gave (empty losses and `error` when a run failed)."""

    reference_losses: list[float]
    losses: list[float]
    measured: dict[str, Any] = field(default_factory=dict)
    """With measure: verify.json's measured fields (_measured)."""
    error: str = ""
    dropout: str = ""
    """How dropout was handled (dropout_handling)."""
    gradients: GradientCheck | None = None


@dataclass(frozen=True)
class VerifyResult:
    nproc: int
    """Processes the distributed run used (the plan's world size)."""
    steps: int
    """Optimizer steps each run made."""
    reference_losses: tuple[float, ...]
    """Per-step losses of the single-process run."""
    losses: tuple[float, ...]
    """Per-step global-batch mean losses of the distributed run."""
    parity_max_abs_diff: float
    """Largest per-step |loss - reference loss| (inf if a loss is NaN)."""
    passed: bool
    """parity_max_abs_diff <= PARITY_TOLERANCE, and gradient_max_rel_diff <= GRADIENT_TOLERANCE when checked."""
    measured: dict[str, Any] = field(default_factory=dict)
    """With measure=True: measured vs predicted step time and peak memory."""
    dropout: str = ""
    """How dropout was handled: "disabled in both runs (N dropout calls per step)", "none in the model", ...."""
    error: str = ""
    """Why a run produced no losses, when a caller checks several runs at once and reports each
    (then passed is False and the losses are empty); "" otherwise."""
    gradients: GradientCheck | None = None
    """The first step's gradients against the reference's (None: not checked, e.g. after an error)."""
    device: str = "cpu"
    """Where the program ran: "cpu" (parity checked) or "cuda" (measured only, measure_on_gpus)."""

    @property
    def gradient_max_rel_diff(self) -> float | None:
        """The largest per-parameter relative gradient difference (inf on a gradient problem), None if unchecked."""
        return None if self.gradients is None else self.gradients.max_rel_diff


@dataclass(frozen=True)
class GradientCheck:
    """Every parameter's first-step gradient, as each rank reported it, against the single-device model's."""

    max_rel_diff: float
    """Largest max |grad - reference| / max(max |reference|, GRADIENT_FLOOR x the model's largest gradient entry)
    over every parameter every rank reported (0/0 = 0, x/0 = inf); inf when `problem` is set."""
    worst: str
    """Where max_rel_diff was measured: "<parameter> on rank R" ("" when nothing was compared)."""
    problem: str = ""
    """Why the gradients could not be compared ("": they were): a rank wrote no file, a parameter of the model
    no rank reported, a name or shape the model does not have."""

    @property
    def passed(self) -> bool:
        return not self.problem and self.max_rel_diff <= GRADIENT_TOLERANCE


MODEL_FILES = ("copy", "planned")
"""What `autoplan verify --model-file` runs (train.py's --model-file): the output folder's copy of the model
files (model_code/, the default), or the file the plan was made from (plan.json model.path), in place."""


def verify(out_dir: Path | str, settings: VerifySettings = VerifySettings()) -> VerifyResult:
    """Loss and gradient parity of DIR/train.py on CPU processes against the single-device run (with `measure`,
    step time and peak memory beside the prediction), written to out_dir/verify.json; with device="cuda" (and
    `measure`), the program trains on this machine's GPUs instead and only the measurement is recorded
    (measure_on_gpus). When a run fails, verify.json records the failure (passed false, "error") before the
    UserError saying why is raised."""
    out_dir = Path(out_dir)
    nproc, steps, timeout_s, measure, model_file, device = (settings.nproc, settings.steps, settings.timeout_s,
                                                            settings.measure, settings.model_file, settings.device)
    if device not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        if not measure:
            raise UserError("--device cuda measures the program on this machine's GPUs: add --measure (loss and "
                            "gradient parity are checked on CPU processes: drop --device)")
        return measure_on_gpus(out_dir, nproc, steps, timeout_s)
    plan = _load_plan(out_dir)
    world = plan.parallelism.world_size
    if nproc is None:
        nproc = world
    if nproc != world:
        raise UserError(f"--nproc {nproc} does not match the plan: {plan.parallelism.world_size_arithmetic()}")
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if not (out_dir / "train.py").is_file():
        raise UserError(f"{out_dir} has no train.py: run `autoplan MODEL.py --out {out_dir}` first")
    _check_model_file(model_file, plan, out_dir)
    settings = replace(settings, nproc=nproc)
    try:
        check_program_plan(out_dir, plan)
        return _verify_runs(out_dir, plan, settings)
    except UserError as e:
        _compare(out_dir, settings, Runs([], [], error=str(e)))
        raise


_FINGERPRINT_LINE = re.compile(r"^PLAN_FINGERPRINT = ['\"]([0-9a-f]+)['\"]", re.MULTILINE)
"""train.py's PLAN_FINGERPRINT line (codegen/program.py writes its value with repr)."""


def check_program_plan(out_dir: Path, plan: Plan) -> None:
    """A UserError unless out_dir/train.py was generated from `plan` (its PLAN_FINGERPRINT is plan.fingerprint()):
    verify certifies the plan in plan.json, and a train.py of another plan would pass its own parity check."""
    match = _FINGERPRINT_LINE.search((out_dir / "train.py").read_text())
    if match is None:
        raise UserError(f"{out_dir}/train.py carries no PLAN_FINGERPRINT (an older autoplan wrote it, or it was "
                        f"edited): verify cannot tell it implements {out_dir}/plan.json; plan again to regenerate it")
    if match.group(1) != plan.fingerprint():
        raise UserError(f"{out_dir}/train.py was not generated from {out_dir}/plan.json (train.py's "
                        f"PLAN_FINGERPRINT {match.group(1)}, plan.json's {plan.fingerprint()}; plan.json is for "
                        f"{plan.parallelism.world_size_arithmetic()}): put the train.py generated with "
                        f"that plan beside it, or plan again")


def _check_model_file(model_file: str, plan: Plan, out_dir: Path) -> None:
    if model_file not in MODEL_FILES:
        raise UserError(f"--model-file must be one of {', '.join(MODEL_FILES)}, got {model_file!r}")
    if model_file == "planned":
        if not Path(plan.model.path).is_file():
            raise UserError(f"--model-file planned runs {plan.model.path}, the file this plan was made from, "
                            f"which is not there now: verify the copy in {out_dir} (without --model-file)")
        if "--model-file" not in (out_dir / "train.py").read_text():
            raise UserError(f"{out_dir}/train.py has no --model-file option (an older autoplan wrote it): "
                            f"plan again to run the planned file")


def _verify_runs(out_dir: Path, plan: Plan, settings: VerifySettings) -> VerifyResult:
    nproc, steps, measure, model_file = settings.nproc, settings.steps, settings.measure, settings.model_file
    with tempfile.TemporaryDirectory(prefix="autoplan-verify-") as tmp:
        ref_out, dist_out, metrics_out, dropout_out, ref_grads, dist_grads = (
            Path(tmp) / n for n in ("reference.json", "losses.json", "metrics.json", "dropout.json",
                                    "reference_gradients", "gradients"))
        from autoplan.runtime.harness.hooks import verify_environment  # not at import: torch

        common = list(run_args(steps)) + (["--model-file", model_file] if model_file != "copy" else [])
        reference = [*REFERENCE_COMMAND, "train.py", "--gradients-out", str(ref_grads), "--dropout-out",
                     str(dropout_out), "--", *common, "--losses-out", str(ref_out)]
        distributed = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                       "train.py", *common, "--losses-out", str(dist_out)]
        if measure:
            distributed += ["--metrics-out", str(metrics_out)]
        runs = [_Run("reference run", reference, out_dir, Path(tmp)),
                _Run(f"distributed run ({nproc} processes)", distributed, out_dir, Path(tmp),
                     verify_environment(dist_grads))]
        # measuring: one run at a time so the timing is not disturbed; else both at once
        _run_all(runs, settings.timeout_s, sequential=measure)
        reference_losses = _read_losses(ref_out, runs[0], steps)
        losses = _read_losses(dist_out, runs[1], steps)
        metrics = json.loads(metrics_out.read_text()) if measure else {}
        dropout = dropout_handling(dropout_out)
        gradients = compare_gradients(ref_grads, dist_grads, nproc)

    return _compare(out_dir, settings, Runs(reference_losses, losses, _measured(plan, metrics) if measure else {},
                                            dropout=dropout, gradients=gradients))


DEVICES = ("cpu", "cuda")
"""Where verify runs the program: CPU processes (gloo; parity, optionally measured) or this machine's GPUs
(NCCL; measured only)."""
GPU_PARITY_NOTE = ("not checked on cuda: the program trains in the plan's dtype (bf16 mixed precision) there, the "
                   "single-device reference in fp32, so their losses differ by more than rounding; `autoplan verify "
                   "DIR` checks loss and gradient parity on CPU processes")


def _gpus_for(plan: Plan, nproc: int | None) -> int:
    """The plan's world size, if this machine has that many CUDA GPUs (else a UserError saying so)."""
    import torch  # not at import: verify's CPU path runs the programs without it

    world = plan.parallelism.world_size
    if nproc is not None and nproc != world:
        raise UserError(f"--nproc {nproc} does not match the plan: {plan.parallelism.world_size_arithmetic()}")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world:
        raise UserError(f"--device cuda runs the plan's {world} processes on one GPU each, but this machine has "
                        f"{have} CUDA GPU{'s' if have != 1 else ''}: plan for --gpus {have} or fewer, or verify on "
                        f"CPU (drop --device)" if have else
                        f"--device cuda needs CUDA GPUs, but torch {torch.__version__} sees none on this machine: "
                        f"verify on CPU (drop --device)")
    return world


def measure_on_gpus(out_dir: Path, nproc: int | None = None, steps: int = 10, timeout_s: float = 600) -> VerifyResult:
    """Train DIR/train.py for `steps` steps on the plan's number of this machine's GPUs (torchrun, NCCL, the
    plan's dtype and compile setting; dropout as in training) and record its step time, MFU and peak memory
    beside the prediction in verify.json ("device": "cuda"; parity is not checked there: GPU_PARITY_NOTE).
    `passed` is whether the run trained to finite losses."""
    plan = _load_plan(out_dir)
    if not (out_dir / "train.py").is_file():
        raise UserError(f"{out_dir} has no train.py: run `autoplan MODEL.py --out {out_dir}` first")
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    world = _gpus_for(plan, nproc)
    check_program_plan(out_dir, plan)
    # each rank's share of the host's cores (rank 0 builds the model on the CPU: one thread is slow for that)
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))}
    run = train_and_measure(out_dir, plan, VerifySettings(world, steps, timeout_s, device="cuda"), env=threads)
    losses, measured = list(run.losses), run.measured
    finite = all(math.isfinite(x) for x in losses)
    report = {"device": "cuda", "nproc": world, "steps": steps, "losses": losses, "passed": finite,
              "parity": GPU_PARITY_NOTE, **measured}
    if not finite:
        report["error"] = "a loss is not finite (NaN or infinity): the run diverged"
    (out_dir / "verify.json").write_text(json.dumps(report, indent=2) + "\n")
    return VerifyResult(nproc=world, steps=steps, reference_losses=(), losses=tuple(losses),
                        parity_max_abs_diff=math.nan, passed=finite, measured=measured, device="cuda",
                        error=report.get("error", ""))


@dataclass(frozen=True)
class MeasuredRun:
    """One measured training run of a generated program (train_and_measure)."""

    losses: tuple[float, ...]
    measured: dict[str, Any]
    """verify.json's measured fields (_measured): step time, peak memory, per rank and stage, MFU on a GPU."""
    steps: tuple[dict[str, Any], ...]
    """train.py's per-step records (rank 0's: seconds, peak_memory_bytes, mfu, ...)."""
    stderr: str
    """What the run printed on stderr (torch's logs, e.g. TORCH_LOGS=recompiles)."""


def train_and_measure(out_dir: Path, plan: Plan, settings: VerifySettings, extra_args: tuple[str, ...] = (),
                      env: dict[str, str] | None = None) -> MeasuredRun:
    """Run DIR/train.py on settings.nproc processes on settings.device (torchrun) for settings.steps steps with
    --metrics-out and `extra_args` (e.g. --no-compile), as it trains (dropout kept), and measure it against
    `plan`."""
    steps = settings.steps
    with tempfile.TemporaryDirectory(prefix="autoplan-measure-") as tmp:
        losses_out, metrics_out = Path(tmp) / "losses.json", Path(tmp) / "metrics.json"
        run = run_train_py(out_dir, settings, ("--steps", str(steps), "--losses-out", str(losses_out),
                                               "--metrics-out", str(metrics_out), *extra_args), env, Path(tmp))
        losses = _read_losses(losses_out, run, steps)
        metrics = json.loads(metrics_out.read_text())
        stderr = run.stderr_path.read_text(errors="replace")
    return MeasuredRun(tuple(losses), _measured(plan, metrics, device=settings.device), tuple(metrics["steps"]),
                       stderr)


def run_train_py(out_dir: Path, settings: VerifySettings, args: tuple[str, ...], env: dict[str, str] | None,
                 tmp: Path) -> _Run:
    """Run DIR/train.py --device settings.device `args` on settings.nproc processes (torchrun) in a session of its
    own, its stderr kept under `tmp`; killed with its ranks after settings.timeout_s (a UserError then, or when it
    fails)."""
    device, nproc = settings.device, settings.nproc
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "train.py", "--device", device, *args]
    run = _Run(f"{device} run ({nproc} process{'es' if nproc != 1 else ''})", command, out_dir, tmp, env)
    _run_all([run], settings.timeout_s, sequential=True)
    return run


VERIFY_CLIP_GRAD_NORM = 1e-3
"""The gradient clipping norm of both runs of a parity check: below any model's gradient norm, so clipping always
acts and the first step's gradients (compared after clipping) hold the global norm each layout computes."""


REFERENCE_COMMAND = (sys.executable, "-m", "autoplan.runtime.harness.reference")
"""The single-device reference run of a train.py (runtime/harness/reference.py), with its program, its own flags, `--` and
train.py's."""


def run_args(steps: int) -> tuple[str, ...]:
    """train.py arguments both runs of a parity check take: CPU, `steps` steps, clipping that always acts
    (VERIFY_CLIP_GRAD_NORM); the learning rate schedule is train.py's own. Dropout is off on both sides: the
    harness's reference and the hook verify sets for the distributed run (AUTOPLAN_VERIFY)."""
    return ("--device", "cpu", "--steps", str(steps), "--clip-grad-norm", str(VERIFY_CLIP_GRAD_NORM))


def dropout_handling(path: Path) -> str:
    """How dropout was handled, from the reference run's --dropout-out file (dropout calls per step)."""
    try:
        calls = float(json.loads(path.read_text())["disabled_calls_per_step"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return "not reported by the reference run (no --dropout-out file): dropout may not have been disabled"
    if calls <= 0:
        return "none in the model (no dropout call with p > 0 ran)"
    return f"disabled in both runs ({calls:g} dropout call{'s' if calls != 1 else ''} per step); training keeps it"


def _compare(out_dir: Path, settings: VerifySettings, runs: Runs) -> VerifyResult:
    """The parity verdict of `runs` (losses, and the gradients when checked) on settings.nproc processes, also
    written to out_dir/verify.json."""
    nproc, steps, model_file = settings.nproc, settings.steps, settings.model_file
    reference_losses, losses, measured, error, dropout, gradients = (runs.reference_losses, runs.losses, runs.measured,
                                                                     runs.error, runs.dropout, runs.gradients)
    diffs = [abs(a - b) for a, b in zip(reference_losses, losses)]
    max_diff = math.inf if error or any(math.isnan(d) for d in diffs) else max(diffs)
    passed = max_diff <= PARITY_TOLERANCE and (gradients is None or gradients.passed)
    result = VerifyResult(nproc=nproc, steps=steps, reference_losses=tuple(reference_losses), losses=tuple(losses),
                          parity_max_abs_diff=max_diff, passed=passed, measured=measured,
                          dropout=dropout, error=error, gradients=gradients)
    report = {"nproc": nproc, "steps": steps, "reference_losses": list(reference_losses), "losses": list(losses),
              "parity_max_abs_diff": max_diff if math.isfinite(max_diff) else None,
              "parity_tolerance": PARITY_TOLERANCE, "passed": result.passed, "model_file": model_file, **measured}
    if gradients is not None:
        report["gradient_max_rel_diff"] = gradients.max_rel_diff if math.isfinite(gradients.max_rel_diff) else None
        report["gradient_tolerance"] = GRADIENT_TOLERANCE
        report["gradient_floor"] = GRADIENT_FLOOR
        report["gradient_worst"] = gradients.worst
        if gradients.problem:
            report["gradient_problem"] = gradients.problem
    if dropout:
        report["dropout"] = dropout
    if error:
        report["error"] = error
    (out_dir / "verify.json").write_text(json.dumps(report, indent=2) + "\n")
    return result


def compare_gradients(reference_dir: Path, distributed_dir: Path, nproc: int) -> GradientCheck:
    """The gradients ranks 0..nproc-1 wrote to distributed_dir against the reference's in reference_dir
    (the verify hook's and the reference's gradients_out, runtime/distributed/gradients.py)."""
    import torch  # not at import: the rest of verify runs the programs without it

    from autoplan.runtime.distributed.gradients import GRADIENTS_FILE

    def load(directory: Path, rank: int) -> dict | None:
        path = directory / GRADIENTS_FILE.format(rank=rank)
        return torch.load(path, weights_only=True) if path.is_file() else None

    reference = load(reference_dir, 0)
    if reference is None:
        return GradientCheck(math.inf, "", "the reference run wrote no gradients (runtime/harness/reference.py --gradients-out)")
    expected = reference["gradients"]
    floor = GRADIENT_FLOOR * max((float(g.abs().max()) for g in expected.values() if g.numel()), default=0.0)
    group_of = {name: tuple(names) for names in reference["aliases"] for name in names}
    unreported = {group_of.get(name, (name,)) for name in expected}  # each parameter by all its names
    worst, worst_at = 0.0, ""
    for rank in range(nproc):
        found = load(distributed_dir, rank)
        if found is None:
            return GradientCheck(math.inf, "", f"rank {rank} of the distributed run wrote no gradients "
                                               f"(train.py's verify hook, runtime/harness/hooks.py)")
        for name, grad in found["gradients"].items():
            want = expected.get(name)
            if want is None:
                return GradientCheck(math.inf, "", f"rank {rank} reports a gradient for {name!r}, a name the "
                                                   f"model's parameters do not have")
            if grad.shape != want.shape:
                return GradientCheck(math.inf, "", f"rank {rank}'s gradient of {name!r} has shape "
                                                   f"{tuple(grad.shape)}, the model's {tuple(want.shape)}")
            unreported.discard(group_of.get(name, (name,)))
            rel = _relative_difference(grad, want, floor)
            if rel > worst or not worst_at:
                worst, worst_at = rel, f"{name} on rank {rank}"
    if unreported:
        missing = sorted(names[0] for names in unreported)
        return GradientCheck(math.inf, worst_at, f"no rank reports the gradient of {len(missing)} of the model's "
                                                 f"parameters (e.g. {missing[0]!r})")
    return GradientCheck(worst, worst_at)


def _relative_difference(grad: Any, want: Any, floor: float) -> float:
    """max |grad - want| / max(max |want|, floor) (0/0 = 0, x/0 = inf, NaN anywhere = inf)."""
    if not want.numel():
        return 0.0
    diff, scale = float((grad - want).abs().max()), max(float(want.abs().max()), floor)
    if math.isnan(diff) or math.isnan(scale):
        return math.inf
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def _load_plan(out_dir: Path) -> Plan:
    if not (out_dir / "plan.json").is_file():
        raise UserError(f"{out_dir} has no plan.json: is it an autoplan output folder?")
    return load_plan(out_dir / "plan.json")


MEASURED_ON = {
    "cpu": ("cpu (gloo): step time = median over steps (not the first, not the memory-tracked last) of each "
            "rank's wall time, the slowest rank's; peak memory = peak of live tensor storage bytes during "
            "the last step, the fullest rank's"),
    "cuda": ("cuda (nccl): step time = median over steps (not the first, not the memory-tracked last) of each "
             "rank's wall time to the step's loss on the host, the slowest rank's; MFU = the plan's model FLOPs per "
             "step / (that step time x GPUs x the planned GPU's dense peak); peak memory = "
             "torch.cuda.max_memory_allocated during the last step, the fullest rank's"),
}
"""How verify --measure measures, per device."""


def _timed_steps(times: list[float], tracked: int | None) -> list[float]:
    """Step times without the warm-up (first) step and the memory-tracked one, when others remain."""
    kept = [t for i, t in enumerate(times) if i != 0 and i != tracked]
    return kept or [t for i, t in enumerate(times) if i != tracked] or times


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _error(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1 if measured > 0 else None


MEASURED_PART_OF = {"parameters": "parameters", "gathered_parameters": "parameters", "gradients": "gradients",
                    "optimizer": "optimizer"}
"""The plan's memory categories (cost/memory.py) in the parts PeakLiveMemory sorts a measured peak into
(runtime/components/memory.py PEAK_PARTS); every other category is "activations". FSDP2's gathered copies are nn.Parameters."""


def predicted_parts(breakdown: dict[str, float], dtype: str) -> dict[str, float]:
    """A plan's memory breakdown in the measured peak's parts. FSDP2's accumulated unsharded gradients are the
    gathered parameter's .grad when the reduce dtype is the training dtype (fp32), else a tensor of its own."""
    parts = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "buffers": 0.0, "activations": 0.0}
    for category, value in breakdown.items():
        part = MEASURED_PART_OF.get(category, "activations")
        if category == "unsharded_gradients" and dtype == "fp32":
            part = "gradients"
        parts[part] += value
    return parts


def _measured(plan: Plan, metrics: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Per rank and overall: measured step time and peak live tensor memory against the plan's (and on a GPU
    the MFU that step time gives, against the plan's)."""
    stage_memory = {s.index: s.predicted_memory_bytes for s in plan.stages}
    ranks = []
    for r in metrics["ranks"]:
        ranks.append({
            "rank": r["rank"], "pp_rank": r["pp_rank"], "dp_rank": r["dp_rank"], "tp_rank": r["tp_rank"],
            "stages": r["stages"],
            "measured_step_time_s": _median(_timed_steps(r["step_times_s"], r.get("memory_tracked_step"))),
            "predicted_step_time_s": plan.predicted.step_time_s,
            "measured_peak_memory_bytes": r["peak_memory_bytes"],
            "measured_baseline_memory_bytes": r["baseline_memory_bytes"],
            "predicted_peak_memory_bytes": max((stage_memory.get(s, 0.0) for s in r["stages"]), default=0.0),
        })
        if r.get("peak_memory_parts"):  # CPU: what the peak held, beside the plan's parts of the rank's fullest stage
            fullest = max(r["stages"], key=lambda s: stage_memory.get(s, 0.0), default=None)
            breakdown = next((st.memory_breakdown for st in plan.stages if st.index == fullest), {})
            ranks[-1]["measured_peak_memory_parts"] = r["peak_memory_parts"]
            ranks[-1]["predicted_peak_memory_parts"] = predicted_parts(breakdown, plan.training.dtype)
    stages = []
    for s in plan.stages:
        holders = [r["measured_peak_memory_bytes"] for r in ranks if s.index in r["stages"]]
        stages.append({"index": s.index, "modules": list(s.modules), "predicted_time_s": s.predicted_time_s,
                       "predicted_memory_bytes": s.predicted_memory_bytes, "memory_breakdown": dict(s.memory_breakdown),
                       "measured_peak_memory_bytes": max(holders, default=None)})
    step = max(r["measured_step_time_s"] for r in ranks)
    peak = max(r["measured_peak_memory_bytes"] for r in ranks)
    found = {
        "measured_step_time_s": step,
        "predicted_step_time_s": plan.predicted.step_time_s,
        "measured_peak_memory_bytes": peak,
        "predicted_peak_memory_bytes": plan.predicted.peak_memory_bytes,
        "step_time_error": _error(plan.predicted.step_time_s, step),
        "peak_memory_error": _error(plan.predicted.peak_memory_bytes, peak),
        "measured_on": MEASURED_ON[device],
        "predicted_for": plan.cluster.gpu,
        "ranks": ranks,
        "stages": stages,
    }
    if device == "cuda":  # the same FLOPs and peak as the prediction's MFU: it scales with 1 / step time
        found["measured_mfu"] = plan.predicted.mfu * plan.predicted.step_time_s / step if step > 0 else None
        found["predicted_mfu"] = plan.predicted.mfu
    return found


class _Run:
    """One subprocess in its own session, its stderr kept in a file for the error message."""

    def __init__(self, name: str, command: list[str], cwd: Path, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.cwd, self.env = name, command, cwd, env or {}
        self.stderr_path = tmp / f"{name.split()[0]}.stderr"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(self.command, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)

    def kill(self) -> None:
        if self.process is not None:
            kill_process_tree(self.process)

    def stderr_tail(self) -> str:
        """The first exception of any rank on one line (root_cause), then the last lines of stderr."""
        lines = self.stderr_path.read_text(errors="replace").splitlines() if self.stderr_path.exists() else []
        cause = root_cause(lines)
        return (f"first exception: {cause}\n" if cause else "") + f"last lines of its stderr:\n{self._tail(lines)}"

    @staticmethod
    def _tail(lines: list[str]) -> str:
        shown = first_traceback(lines)[-STDERR_TAIL_LINES:]
        if not any(line.startswith("[rank") and "Traceback (most recent call last)" in line for line in shown):
            # no rank's traceback (only its warnings, or only torchrun's own): a rank died by a signal?
            # and what a native abort printed (a C++ exception's message, a fatal Python error)
            signal_lines = r"terminate called|what\(\):|Fatal Python error|exitcode|Signal \d+|rank\s*:"
            shown += [line.strip() for line in lines if re.search(signal_lines, line)][-8:]
        return "\n".join(shown) or "(no output on stderr)"


def first_traceback(lines: list[str]) -> list[str]:
    """The first failing rank's lines (torchrun prefixes them "[rankN]:" once the process group is
    up), else the first Python traceback up to its exception line, else all lines. torchrun's own
    summary comes later and only says which rank failed."""
    ranked = [re.match(r"\[rank(\d+)\]:(.*)", line) for line in lines]
    first_rank = next((m.group(1) for m in ranked if m), None)
    if first_rank is not None:
        return [f"[rank{first_rank}]:{m.group(2)}" for m in ranked if m and m.group(1) == first_rank]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return lines
    end = next((j for j in range(start + 1, len(lines)) if lines[j] and not lines[j][0].isspace()), len(lines) - 1)
    return lines[start:end + 1]


ROOT_CAUSE_CHARS = 400
"""A root-cause line longer than this is cut (a message that prints a whole tensor)."""
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]: ?(.*)")
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')
_LIBRARY_FILE = re.compile(r"[/\\]torch[/\\]|^<|[/\\]lib[/\\]python3[.\d]*[/\\](?!site-packages)"
                           r"|[/\\]autoplan[/\\]runtime[/\\]distributed[/\\]dropout\.py$")
"""Frames of torch, generated code (<eval_with_key>, <frozen ...>), the Python library and autoplan's
no-dropout mode (a torch-function mode every op passes through under verify): not where a model's
failure is."""


def root_cause(lines: list[str]) -> str | None:
    """The first exception of the failing rank's stderr as one line: "<Type>: <message> (rank R, at
    FILE:LINE in FUNC)", FILE:LINE the innermost frame outside torch and the Python library, if any.

    Chained exceptions print the original first ("raise RuntimeError(...) from e", as torch's pipeline
    stages do around a failing forward: "[Stage 1] failed to run forward: args: ..."), so the first
    traceback of a rank holds the root cause. The rank is the one torchrun names as the root cause, else
    the first rank with a traceback; without rank prefixes the lines are one process's. None when no
    traceback ends in an exception line."""
    by_rank: dict[str | None, list[str]] = {}
    for line in lines:
        match = _RANK_PREFIX.match(line)
        rank, text = (match.group(1), match.group(2)) if match else (None, line)
        by_rank.setdefault(rank, []).append(text)
    ranks = [r for r in by_rank if r is not None]
    named = _torchrun_root_rank(lines)
    signal = _torchrun_root_signal(lines)
    if named is not None and signal and not _first_exception(by_rank.get(named, [])):
        return f"rank {named} ended by {signal}, without a Python traceback (a native abort, or killed)"
    order = ([named] if named in ranks else []) + [r for r in ranks if r != named] or [None]
    for rank in order:
        found = _first_exception(by_rank.get(rank, []))
        if found:
            exception, where = found
            context = ", ".join(([f"rank {rank}"] if rank is not None else []) + ([f"at {where}"] if where else []))
            line = exception + (f" ({context})" if context else "")
            return line if len(line) <= ROOT_CAUSE_CHARS else line[:ROOT_CAUSE_CHARS - 3] + "..."
    return None


def _torchrun_root_cause(lines: list[str]) -> list[str]:
    """The lines after torchrun's summary heading "Root Cause (first observed failure)" ([] without one)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Root Cause (first observed failure)")), None)
    return [] if start is None else lines[start + 1:]


def _torchrun_root_rank(lines: list[str]) -> str | None:
    """The rank torchrun's summary names under "Root Cause (first observed failure)", if any."""
    for line in _torchrun_root_cause(lines):
        match = re.match(r"\s*rank\s*:\s*(\d+)", line)
        if match:
            return match.group(1)
    return None


def _torchrun_root_signal(lines: list[str]) -> str | None:
    """The signal that ended the rank torchrun's summary names as the root cause ("signal 6 (SIGABRT)"), if one
    did."""
    for line in _torchrun_root_cause(lines):
        match = re.match(r"\s*traceback\s*:\s*Signal (\d+) \((\w+)\)", line)
        if match:
            return f"signal {match.group(1)} ({match.group(2)})"
    return None


def _first_exception(lines: list[str]) -> tuple[str, str | None] | None:
    """("<Type>: <message>", innermost non-library frame or None) of the first traceback in `lines`."""
    start = next((i for i, line in enumerate(lines) if line.strip() == "Traceback (most recent call last):"), None)
    if start is None:
        return None
    where = None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        frame = _FRAME.match(line)
        if frame and not _LIBRARY_FILE.search(frame.group(1)):
            where = f"{_short_path(frame.group(1))}:{frame.group(2)} in {frame.group(3)}"
        if line.strip() and not line[0].isspace():
            return _exception_text(lines[i:]), where
    return None


_CHAIN_LINES = ("The above exception was the direct cause", "During handling of the above exception",
                "Traceback (most recent call last)")
"""What follows an exception's message in a chain (torchrun drops the blank line before it from the
rank-prefixed lines)."""


def _exception_text(lines: list[str]) -> str:
    """The exception line and its message's continuation lines (up to a blank line or the next exception
    of a chain) joined into one."""
    text = []
    for line in lines:
        if not line.strip() or line.startswith(_CHAIN_LINES):
            break
        text.append(line.strip())
    return " ".join(text)


def _short_path(path: str) -> str:
    """A path relative to the working directory when under it, else as printed."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _run_all(runs: list[_Run], timeout_s: float, sequential: bool) -> None:
    try:
        if sequential:
            for run in runs:
                run.start()
                _wait(run, time.monotonic() + timeout_s, timeout_s)
        else:
            for run in runs:
                run.start()
            deadline = time.monotonic() + timeout_s
            for run in runs:
                _wait(run, deadline, timeout_s)
    finally:
        for run in runs:
            run.kill()


def _wait(run: _Run, deadline: float, timeout_s: float) -> None:
    try:
        code = run.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stuck = running_ranks(run.process.pid)
        run.kill()
        ranks = f" (rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} still running)" if stuck else ""
        raise UserError(f"the {run.name} did not finish within {timeout_s:g} s and was killed{ranks};\n"
                        f"{run.stderr_tail()}") from None
    if code != 0:
        raise UserError(f"the {run.name} failed (exit code {code}):\n{run.stderr_tail()}")


def _read_losses(path: Path, run: _Run, steps: int) -> list[float]:
    try:
        losses = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        raise UserError(f"the {run.name} wrote no losses to {path.name};\n"
                        f"{run.stderr_tail()}") from None
    if not isinstance(losses, list) or len(losses) != steps:
        count = len(losses) if isinstance(losses, list) else "no list of"
        raise UserError(f"the {run.name} wrote {count} losses, expected {steps}")
    return [float(x) for x in losses]
