"""The `autoplan` command: one function per subcommand, thin over autoplan.api.

    autoplan MODEL.py --gpus N [...]        plan (the default subcommand)
    autoplan plan MODEL.py --gpus N [...]
    autoplan profile MODEL.py [--gpu NAME] [--measure] [--out DIR]
    autoplan verify DIR [--nproc K] [--steps S] [--measure] [--model-file copy|planned] [--device cuda]
    autoplan calibrate --out PROFILE.yaml [--nproc K]      measure this machine (or run under torchrun)
    autoplan calibrate --refit DIR --hardware PROFILE.yaml --out NEW.yaml

Exit codes: 0 success, 2 bad input or infeasible (one line on stderr), 1 internal error,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM).

The user's help (`autoplan --help`) is USAGE, DESCRIPTION, the plan options and EPILOG below.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from autoplan.errors import UserError
from autoplan.verify import MODEL_FILES

SUBCOMMANDS = ("plan", "profile", "verify", "calibrate")

USAGE = """autoplan MODEL.py --gpus N [options]             (same as: autoplan plan MODEL.py --gpus N ...)
       autoplan profile|verify|calibrate ...             (autoplan SUBCOMMAND --help for its options)
       autoplan --version"""

DESCRIPTION = """\
autoplan finds how to train an unmodified PyTorch model on N GPUs (data, tensor and pipeline
parallelism, micro-batches, recompute), predicts its step time and memory, and writes the torchrun
program that trains it.

subcommands:
  plan MODEL.py --gpus N    (the default) choose a layout; write plan.json, train.py, launch/, report.html
  profile MODEL.py          capture and profile the model only: ops.csv, modules.csv (FLOPs, bytes, time)
  verify DIR                run a planned program on CPU/gloo processes and check its loss matches one device
  calibrate --out P.yaml    measure this machine into a hardware profile (--refit DIR rescales a profile)

MODEL.py defines build_model() and example_batch(batch_size) (loss_fn optional);
MODEL.py:factory names another factory than build_model."""

EPILOG = """\
exit codes: 0 success; 2 bad input or no layout fits (one line on stderr, --debug for a traceback);
1 internal error (verify: loss or gradient parity failed); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM).

example: autoplan examples/llama.py:llama3_8b --gpus 8 --out llama_plan"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + message."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see --help)")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--quiet", action="store_true", help="print only errors")


def _gpu_help(default: str) -> str:
    """--gpu's help: the packaged hardware profiles by name."""
    from autoplan.hardware.profiles import known_hardware

    names = ", ".join(known_hardware()) or "a profile name"
    return f"hardware profile: {names} (default {default}; cpu = processes on this machine, measured op timings)"


def _pin_help() -> str:
    """--pin's help: the pin keys and the values of the word-valued ones (autoplan/layout.py)."""
    from autoplan.layout import RECOMPUTE, SCHEDULES, SEQUENCE_PARALLEL, ZERO_STAGES
    from autoplan.solve.pins import PIN_KEYS

    return (f"fix layout choices: {', '.join(PIN_KEYS)}; schedule is {' | '.join(SCHEDULES)}, recompute "
            f"{' | '.join(RECOMPUTE)}, zero {' | '.join(map(str, ZERO_STAGES))}, sp "
            f"{' | '.join(SEQUENCE_PARALLEL)} (default on with tp > 1); e.g. tp=8,pp=4,dp=2,zero=3 "
            "(docs/layouts.md lists every name); repeatable: --pin ep=2 --pin pp=2 is --pin ep=2,pp=2")


def _plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL.py", help="the model file, or MODEL.py:factory")
    parser.add_argument("--gpus", metavar="N", required=True, help="number of accelerators (GPUs, or cpu processes)")
    parser.add_argument("--gpu", metavar="NAME", default="h100-sxm5-80gb", help=_gpu_help("h100-sxm5-80gb"))
    parser.add_argument("--gpus-per-node", metavar="K", default=None,
                        help="GPUs per node: groups within a node use the profile's intra-node link (NVLink), "
                        "across nodes its network (default: the profile's node size, 8 for the GPUs)")
    parser.add_argument("--global-batch", metavar="B", default=None,
                        help="samples per optimizer step (default 4 per GPU)")
    parser.add_argument("--dtype", metavar="bf16|fp32", default=None,
                        help="training precision (default bf16 on GPUs, fp32 on cpu)")
    parser.add_argument("--memory-per-gpu", metavar="SIZE", default=None, help="cap usable memory per GPU, e.g. 40GiB")
    parser.add_argument("--host-memory-per-node", metavar="SIZE", default=None,
                        help="host memory per node for CPU offload, e.g. 1TiB (default: the hardware profile's)")
    parser.add_argument("--pin", metavar="K=V,...", action="append", default=None, help=_pin_help())
    parser.add_argument("--hardware", metavar="PROFILE.yaml", default=None,
                        help="a hardware profile file, e.g. from autoplan calibrate (overrides --gpu)")
    parser.add_argument("--out", metavar="DIR", default="autoplan_out", help="output folder (default autoplan_out)")
    parser.add_argument("--solver", metavar="highs|cbc", default="highs", help="MILP solver (default highs)")
    parser.add_argument("--measure", action="store_true", default=None,
                        help="price with op times measured on this machine: on a GPU machine its GPU stands for "
                             "--gpu's, ops timed in the plan's dtype (default: measured for --gpu cpu only)")
    parser.add_argument("--time-limit", metavar="S", default=None, type=float, help="solver time limit, seconds")
    parser.add_argument("--json", action="store_true", help="print plan.json to stdout instead of the summary")
    _common(parser)


def build_parser() -> dict[str, argparse.ArgumentParser]:
    plan = _Parser(prog="autoplan plan", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _plan_args(plan)
    profile = _Parser(prog="autoplan profile", description="Capture and profile a model: ops.csv, modules.csv.")
    profile.add_argument("model", metavar="MODEL.py", help="the model file, or MODEL.py:factory")
    profile.add_argument("--gpu", metavar="NAME", default="cpu", help=_gpu_help("cpu"))
    profile.add_argument("--hardware", metavar="PROFILE.yaml", default=None,
                         help="a hardware profile file (overrides --gpu)")
    profile.add_argument("--measure", action="store_true", help="time ops on this machine")
    profile.add_argument("--out", metavar="DIR", default="autoplan_profile",
                         help="output folder (default autoplan_profile)")
    _common(profile)
    verify = _Parser(prog="autoplan verify",
                     description="Run a generated program on CPU/gloo and check loss and gradient parity; with "
                                 "--device cuda --measure, train it on this machine's GPUs and measure it.")
    verify.add_argument("dir", metavar="DIR", help="an output folder of autoplan plan")
    verify.add_argument("--nproc", type=int, default=None, help="processes to run (default: the plan's GPU count)")
    verify.add_argument("--steps", type=int, default=3, help="training steps compared (default 3)")
    verify.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    verify.add_argument("--measure", action="store_true",
                        help="also record step time and peak memory next to the prediction (verify.json)")
    verify.add_argument("--model-file", choices=MODEL_FILES, default="copy",
                        help="copy: run the copy of the model file (and of the modules beside it that it imports) "
                             "that DIR/model_code/ holds, made at planning (default); planned: run the file the plan "
                             "was made from (plan.json model.path), in place, as it is now")
    verify.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: parity on CPU processes (default); cuda (with --measure): train on this machine's "
                             "GPUs and record step time, MFU and peak memory beside the prediction")
    _common(verify)
    calibrate = _Parser(prog="autoplan calibrate", description="Measure this machine into a hardware profile "
                        "YAML (launches torchrun, or runs under it); with --refit, rescale a profile to a verified run.")
    calibrate.add_argument("--out", required=True, help="the hardware profile YAML to write")
    calibrate.add_argument("--nproc", type=int, default=None, help="ranks to launch (default 2 on CPU, every GPU on CUDA)")
    calibrate.add_argument("--gpu", default=None, help="profile whose datasheet peaks to keep (default: the device's)")
    calibrate.add_argument("--hardware", default=None, help="base profile YAML (overrides --gpu); with --refit, "
                           "the profile the verified plan was made with")
    calibrate.add_argument("--refit", default=None, metavar="VERIFY_DIR",
                           help="an output folder with verify.json from `autoplan verify --measure`")
    calibrate.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is killed")
    _common(calibrate)
    return {"plan": plan, "profile": profile, "verify": verify, "calibrate": calibrate}


def cmd_plan(args) -> int:
    from autoplan.api import PlanOptions, plan_model

    with _progress(args):
        result = plan_model(args.model, args.gpus, args.gpu, PlanOptions(
            gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, dtype=args.dtype,
            memory_per_gpu=args.memory_per_gpu, host_memory_per_node=args.host_memory_per_node,
            pin=",".join(args.pin) if args.pin else None, hardware=args.hardware, solver=args.solver,
            measure=args.measure, time_limit=args.time_limit, out=args.out))
    if args.json:
        print(result.plan.to_json())
    elif not args.quiet:
        Console().print(summary(result.plan, args.out))
    return 0


def cmd_profile(args) -> int:
    from autoplan.api import ProfileOptions, profile_only

    with _progress(args):
        options = ProfileOptions(hardware=args.hardware, measure=args.measure or None, out=args.out)
        profile = profile_only(args.model, args.gpu, options)
    if not args.quiet:
        flops = sum(o.flops_fwd + o.flops_bwd for o in profile.ops)
        print(f"{len(profile.ops)} ops, {profile.param_count:,} parameters, "
              f"{flops / profile.batch_size:.3g} FLOPs per sample (fwd+bwd), captured by {profile.capture_method}")
        print(f"wrote {args.out}/ops.csv, modules.csv, unsupported_ops.txt, profile.json")
    return 0


def cmd_verify(args) -> int:
    from autoplan.verify import GRADIENT_TOLERANCE, PARITY_TOLERANCE, VerifySettings, verify

    try:
        with _progress(args):
            result = verify(args.dir, VerifySettings(nproc=args.nproc, steps=args.steps, timeout_s=args.timeout,
                                                     measure=args.measure, model_file=args.model_file,
                                                     device=args.device))
    finally:  # a failed run's verify.json (passed false, the error) goes into the report too
        _add_verification(Path(args.dir))
    if result.device == "cuda":
        if not args.quiet:
            print(gpu_measurement_text(result))
        return 0 if result.passed else 1
    if not args.quiet:
        if result.dropout:
            print(f"dropout: {result.dropout}")
        losses_pass = result.parity_max_abs_diff <= PARITY_TOLERANCE
        print(f"loss parity over {result.steps} steps on {result.nproc} processes: "
              f"max |diff| = {result.parity_max_abs_diff:.3g} ({'PASS' if losses_pass else 'FAIL'}, "
              f"limit {PARITY_TOLERANCE:g})")
        gradients = result.gradients  # checked whenever both runs trained (an older train.py stops at RUNTIME_API)
        if gradients.problem:
            print(f"first-step gradients: FAIL, {gradients.problem}")
        else:
            print(f"first-step gradients of every parameter on every rank: max relative diff = "
                  f"{gradients.max_rel_diff:.3g} at {gradients.worst} ({'PASS' if gradients.passed else 'FAIL'}, "
                  f"limit {GRADIENT_TOLERANCE:g})")
    return 0 if result.passed else 1


def _add_verification(out_dir: Path) -> None:
    """Put out_dir/verify.json into out_dir/report.html, when both are there."""
    if (out_dir / "report.html").is_file() and (out_dir / "verify.json").is_file():
        from autoplan.report.html import add_verification

        try:
            recorded = json.loads((out_dir / "verify.json").read_text())
        except (OSError, ValueError):
            return  # an edited verify.json: the report keeps what it had
        add_verification(out_dir, recorded)


def gpu_measurement_text(result) -> str:
    """What `autoplan verify --device cuda --measure` prints: measured beside predicted, and their ratios."""
    m = result.measured
    step, predicted = m["measured_step_time_s"], m["predicted_step_time_s"]
    peak, predicted_peak = m["measured_peak_memory_bytes"], m["predicted_peak_memory_bytes"]
    lines = [f"trained {result.steps} steps on {result.nproc} GPU{'s' if result.nproc != 1 else ''}: "
             f"losses {result.losses[0]:.4g} -> {result.losses[-1]:.4g}"
             + ("" if result.passed else f" ({result.error})"),
             f"step time  {step * 1e3:.1f} ms measured, {predicted * 1e3:.1f} ms predicted "
             f"(measured / predicted {step / predicted:.3f})"]
    if m.get("measured_mfu") is not None:
        lines.append(f"MFU        {m['measured_mfu'] * 100:.1f}% measured, {m['predicted_mfu'] * 100:.1f}% predicted")
    lines.append(f"peak memory {peak / 2**30:.2f} GiB measured, {predicted_peak / 2**30:.2f} GiB predicted "
                 f"(measured / predicted {peak / predicted_peak:.3f})" if predicted_peak else
                 f"peak memory {peak / 2**30:.2f} GiB measured")
    lines.append("loss and gradient parity: checked on CPU processes (autoplan verify DIR), not on cuda")
    return "\n".join(lines)


def cmd_calibrate(args) -> int:
    base = args.hardware or args.gpu
    if args.refit is not None:
        from autoplan.calibrate.refit import refit

        if base is None:
            raise UserError("--refit needs --hardware PROFILE.yaml: the profile the verified plan was made with")
        if args.nproc is not None:
            raise UserError("--nproc launches a calibration run; --refit only reads VERIFY_DIR: drop one of them")
        result = refit(args.refit, base, args.out)
        if not args.quiet:
            print(f"measured {result.measured_s:.4g} s/step, predicted {result.predicted_before_s:.4g} s; compute-side "
                  f"times x{result.compute_factor:.3g}, communication x{result.comm_factor:.3g} -> predicts "
                  f"{result.predicted_after_s:.4g} s")
            for note in result.notes:
                print(f"note: {note}")
            print(f"wrote {args.out}")
        return 0
    from autoplan.calibrate.launch import calibrate

    with _progress(args):
        profile = calibrate(args.out, nproc=args.nproc, base=base, timeout_s=args.timeout)
    if profile is not None and not args.quiet:
        gpu, link = profile.gpu, profile.intra_node
        peaks = ", ".join(f"{dtype} {flops / 1e12:.3g}" for dtype, flops in gpu.peak_flops.items())
        print(f"matmul peak TFLOP/s {peaks} (efficiency {gpu.matmul_efficiency:.2f}); memory "
              f"{gpu.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s (efficiency {gpu.memory_efficiency:.2f}); "
              f"kernel overhead {gpu.kernel_overhead_s * 1e6:.3g} us")
        kept = " (not measured on one rank: the base profile's)" if link.source.startswith("not measured") else ""
        print(f"intra-node {link.name}: {link.bus_bandwidth_bytes_per_s / 1e9:.3g} GB/s bus bandwidth, "
              f"{link.latency_s * 1e6:.3g} us latency; inter-node {profile.inter_node.bus_bandwidth_bytes_per_s / 1e9:.3g} "
              f"GB/s, {profile.inter_node.latency_s * 1e6:.3g} us{kept}")
        print(f"wrote {args.out}; plan with it: autoplan MODEL.py --gpus N --hardware {args.out}")
    return 0


def summary(plan, out: str | None) -> Group:
    """The chosen layout, its prediction and its stages, as rich renderables."""
    from autoplan.solve.layouts import describe

    p, pred, gib = plan.parallelism, plan.predicted, 2**30
    layout = describe(p)
    throughput = f"{pred.samples_per_s:,.1f} samples/s" + (f", {pred.tokens_per_s:,.0f} tokens/s" if pred.tokens_per_s else "")
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("layout", layout)
    head.add_row("predicted", f"{_seconds(pred.step_time_s)}/step, {throughput}, MFU {pred.mfu * 100:.1f}%")
    head.add_row("memory", f"{pred.peak_memory_bytes / gib:.2f} GiB peak of "
                 f"{plan.cluster.memory_per_gpu_bytes / gib:.1f} GiB per {plan.cluster.gpu}")
    if pred.activations_without_sequence_parallel_bytes is not None:
        with_sp = pred.memory_breakdown.get("activations", 0.0)
        head.add_row("activations", f"{with_sp / gib:.2f} GiB with sequence parallel, "
                     f"{pred.activations_without_sequence_parallel_bytes / gib:.2f} GiB without (sp=off)")
    if _has_experts(plan):
        head.add_row("experts", _expert_parallel_line(plan))
    if p.offload:
        head.add_row("host", f"{pred.host_memory_per_node_bytes / gib:,.0f} GiB of host memory per node (CPU offload: "
                     f"parameters, gradients and optimizer state; the optimizer steps on the CPU)")
    if p.tp > 1:
        head.add_row("tensor par.", escape(_tensor_parallel_text(plan)))
    head.add_row("compile", "on (torch.compile per module)" if plan.compile.enable else "off")
    head.add_row("solver", f"{plan.solver.name} {plan.solver.status} in {plan.solver.time_s:.2f} s, "
                 f"{plan.solver.candidates_evaluated} candidates")
    stages = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name, justify in (("stage", "right"), ("time/micro-batch", "right"), ("memory GiB", "right"),
                          ("modules", "left")):
        stages.add_column(name, justify=justify)
    for s in plan.stages:
        span = s.modules[0] if len(s.modules) == 1 else f"{s.modules[0]} .. {s.modules[-1]} ({len(s.modules)})"
        stages.add_row(str(s.index), _seconds(s.predicted_time_s), f"{s.predicted_memory_bytes / gib:.2f}",
                       escape(span))
    parts = [head, stages]
    if out:
        parts.append(f"wrote {escape(out)}/ (plan.json, train.py, launch/, report.html, *.csv, unsupported_ops.txt); "
                     f"{_verify_hint(plan, out)}")
    return Group(*parts)


def _tensor_parallel_text(plan) -> str:
    """What tensor parallelism splits (one line per style) and every kind of block it leaves whole, with why."""
    from autoplan.chain.tensor_parallel import left_whole_lines, split_lines

    lines = split_lines(plan.tensor_parallel_plan)
    whole = left_whole_lines(plan.tensor_parallel_left_whole)
    return "\n".join(lines + (whole or ["every Linear is split"]))


def _has_experts(plan) -> bool:
    """The plan's model has expert layers: it splits them, prices their compute, or an alternative splits them."""
    return (plan.parallelism.ep > 1 or "expert_compute" in plan.predicted.time_breakdown
            or any(a.parallelism.ep > 1 for a in plan.alternatives))


def _expert_parallel_line(plan) -> str:
    """Why the plan splits the experts or not: its expert compute, all-to-all and memory (with ep > 1, beside the
    same layout's with ep=1), and the fastest layout of the other kind (plan.alternatives: ep=1 when the plan has
    ep > 1, ep > 1 when it has ep=1) beside its step time."""
    from autoplan.solve.layouts import describe

    p, pred, gib = plan.parallelism, plan.predicted, 2**30
    split = p.ep > 1
    parts = pred.time_breakdown
    spent = [f"{_seconds(parts['expert_compute'])} expert compute"] if "expert_compute" in parts else []
    if split:
        spent.append(f"{_seconds(parts.get('expert_parallel_comm', 0.0))} all-to-all")
    line = f"ep={p.ep}: " + "".join(f"{s}, " for s in spent) + \
        f"{pred.peak_memory_bytes / gib:.2f} GiB peak"
    if split and pred.peak_memory_without_expert_parallel_bytes is not None:
        line += f", the same layout with ep=1 {pred.peak_memory_without_expert_parallel_bytes / gib:.2f} GiB"
    other = [a for a in plan.alternatives if (a.parallelism.ep > 1) != split and a.step_time_s]
    if other:
        fastest = other[0]
        fits = "" if fastest.fits else ", does not fit"
        kind = "ep=1" if split else "ep > 1"
        line += (f"; the fastest layout with {kind} ({describe(fastest.parallelism)}) takes "
                 f"{_seconds(fastest.step_time_s)}/step ({fastest.step_time_s / pred.step_time_s:.2f}x), "
                 f"{fastest.peak_memory_bytes / gib:.2f} GiB{fits}")
    return line


VERIFY_MAX_PROCESSES = 8
"""Largest plan `autoplan verify` is suggested for: it runs one CPU process per GPU of the plan."""
VERIFY_MAX_MODEL_BYTES = 2**30
"""Largest model (fp32 parameter bytes) it is suggested for: every process trains its share on the CPU and one
more trains the whole model, as the reference."""


def _verify_hint(plan, out: str) -> str:
    """How to check the program here: autoplan verify when the plan is small enough to run on this machine's
    CPU, else the same layout pinned on a shrunken model."""
    processes, model_bytes = plan.cluster.num_gpus, 4 * plan.model.param_count
    if processes <= VERIFY_MAX_PROCESSES and model_bytes <= VERIFY_MAX_MODEL_BYTES:
        return f"check it: autoplan verify {escape(out)}"
    return (f"too large to check on this machine's CPU ({processes} processes, {model_bytes / 2**30:.1f} GiB of "
            f"fp32 weights): check the layout on a shrunken copy of the model with the same --pin and "
            f"autoplan verify")


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value >= 1e-3 else f"{value * 1e6:.0f} us"


@contextmanager
def _progress(args):
    """A spinner naming the running phase on an interactive terminal; plain log lines otherwise."""
    stderr = Console(stderr=True)
    if not stderr.is_terminal or args.quiet or args.debug:
        yield
        return
    root = logging.getLogger()
    previous = root.handlers
    with stderr.status("autoplan ...") as status:
        root.handlers = [_StatusHandler(status)]
        try:
            yield
        finally:
            root.handlers = previous


class _StatusHandler(logging.Handler):
    """Shows the running phase on a spinner (interactive terminals only) and keeps warnings visible."""

    def __init__(self, status) -> None:
        super().__init__(logging.INFO)
        self.status = status

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.status.console.print(f"[yellow]autoplan: {escape(record.getMessage())}[/]")
        else:
            self.status.update(f"{escape(record.getMessage())} ...")


def _version() -> str:
    """The installed distribution's version (torch-autoplan), else the source tree's autoplan.__version__."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-autoplan")
    except PackageNotFoundError:
        import autoplan

        return autoplan.__version__


def _terminate(signum, frame):
    from autoplan.errors import Terminated

    raise Terminated()


class _StderrHandler(logging.StreamHandler):
    """Logs to whatever sys.stderr is when a record is written, not the stream of the first call: main() run
    in-process (a test capturing output, a notebook redirecting it) must not leave a handler on a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        """logging.StreamHandler sets its stream; this one always follows sys.stderr."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if argv and argv[0] in SUBCOMMANDS:
        name, rest = argv[0], argv[1:]
    else:
        name, rest = "plan", argv
    if not argv or argv[0] in ("-h", "--help"):
        print(build_parser()["plan"].format_help().rstrip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"autoplan {_version()}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    try:
        args = build_parser()[name].parse_args(rest)
        logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING if args.quiet else logging.INFO,
                            format="autoplan: %(message)s", force=True, handlers=[_StderrHandler()])
        return {"plan": cmd_plan, "profile": cmd_profile, "verify": cmd_verify,
                "calibrate": cmd_calibrate}[name](args)
    except UserError as e:
        if debug:
            traceback.print_exc()
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from autoplan.errors import Terminated

        print("autoplan: terminated" if isinstance(e, Terminated) else "autoplan: interrupted", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if debug:
            traceback.print_exc()
        print(f"autoplan: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


def run() -> None:
    """The `autoplan` command: main(), then the process ends at once with its exit code. The exit handlers run
    (atexit: logging's flush, multiprocessing's), the interpreter's teardown of every module and object does not:
    freeing a planned model's graphs and torch's modules took 1.1 s of the 1T GPT's 10.5 s command. Everything the
    command writes is written and flushed before."""
    import atexit
    import os

    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    run()
