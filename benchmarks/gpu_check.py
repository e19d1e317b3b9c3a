"""The steps of benchmarks/gpu_check.sh, one subcommand each; every step writes RESULTS/<step>.json and prints
its measured / predicted ratios. gpu_check.sh runs them in order, each under its own timeout, into one log.

    python benchmarks/gpu_check.py detect   --device cuda
    python benchmarks/gpu_check.py plan     --device cuda --results DIR
    python benchmarks/gpu_check.py train    --device cuda --results DIR --plan NAME --run NAME --steps N [--no-compile]
    python benchmarks/gpu_check.py calibrate --device cuda --results DIR
    python benchmarks/gpu_check.py offload  --device cuda --results DIR
    python benchmarks/gpu_check.py checkpoint --device cuda --results DIR
    python benchmarks/gpu_check.py profile  --device cuda --results DIR
    python benchmarks/gpu_check.py summary  --results DIR

--device cpu is the dry run (tests/test_gpu_check.py): the shrunken Llama (benchmarks/models/llama32_1b_shrunk.py)
planned for one CPU process, every step run the same way, so the script cannot rot. It checks the script, not a
GPU: torch.compile is disabled there (TORCHDYNAMO_DISABLE=1, set by gpu_check.sh), no memory is pinned.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "benchmarks" / "models"
MODELS = {"cuda": MODELS_DIR / "llama32_1b.py", "cpu": MODELS_DIR / "llama32_1b_shrunk.py"}
"""The model each mode plans: Llama-3.2-1B's shapes on a GPU, the shrunken copy in the CPU dry run."""
PLANS = {"base": "", "selective": "recompute=selective,compile=on", "full": "recompute=full,compile=on",
         "moe": "compile=off", "moe_compiled": "compile=on", "long": ""}
"""Plans made for one device: the search's own choice, and selective and full recompute under compile. The
eager run trains the base plan with --no-compile, priced by the search's candidate of the same layout with
compile off (the predicted compile speed-up is the ratio of the two predictions). moe and long plan other models
(PLAN_MODELS)."""
PLAN_MODELS = {"moe": (MODELS_DIR / "deepseek_v3_16b_4layers.py", 4),
               "moe_compiled": (MODELS_DIR / "deepseek_v3_16b_4layers.py", 4),
               "long": (MODELS_DIR / "llama32_1b_32k.py", 1)}
"""On a GPU, the model and global batch of the plans that do not train Llama-3.2-1B at 2K tokens: DeepSeek-V3 16B's
first 4 layers (MLA, 64 experts top-6; torchtitan's micro-batch 4 of runs_frontier.csv's row) eager and compiled, and
Llama-3.2-1B at 32K tokens. The CPU dry run plans the shrunken Llama for them (it checks the script)."""
KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "attn", "mha")),
                ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "grouped_mm", "_mm_", "splitk")),
                ("optimizer", ("multi_tensor_apply", "adam")),
                ("collective", ("nccl",)))
"""Kernel names by the cost model's kinds (chain.ops.cost_kind), first match wins; anything else (inductor's
fused Triton kernels, elementwise, reductions, copies) is "memory"."""
RECOMPILES = re.compile(r"Recompiling function")
"""What TORCH_LOGS=recompiles prints once per recompilation."""


def profile_name(device: str) -> str:
    """The packaged hardware profile of this machine's device: h200 or h100 by torch's device name, cpu for
    the dry run. Another GPU is refused (the script is written for one H100 or H200)."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here (torch sees none): run the dry run with --device cpu")
    name = torch.cuda.get_device_name(0)
    for pattern, profile in (("h200", "h200-sxm-141gb"), ("h100", "h100-sxm5-80gb")):
        if pattern in name.lower():
            return profile
    raise SystemExit(f"gpu_check: written for one H100 or H200, this GPU is {name!r}")


def _write(results: Path, step: str, data: dict) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{step}.json").write_text(json.dumps(data, indent=2) + "\n")


def _ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "n/a"
    return f"{measured / predicted:.3f}"


def cmd_detect(args) -> None:
    print(profile_name(args.device))


def cmd_plan(args) -> None:
    """The four plans of PLANS, for one device of this machine's profile; writes plan.json and train.py each."""
    from autoplan.api import PlanOptions, plan_model

    gpu = profile_name(args.device)
    found = {}
    for name in args.plans.split(","):
        pin = PLANS[name]
        model, batch = PLAN_MODELS.get(name, (MODELS[args.device], None)) if args.device == "cuda" else (
            MODELS[args.device], None)
        started = time.perf_counter()
        result = plan_model(str(model), 1, gpu,
                            PlanOptions(pin=pin or None, global_batch=batch, out=args.results / "plans" / name))
        plan, p = result.plan, result.plan.parallelism
        found[name] = {"pin": pin, "planned_in_s": time.perf_counter() - started,
                       "layout": {"microbatch": p.microbatch,
                                  "microbatches": p.microbatches,
                                  "recompute": p.recompute, "compile": plan.compile.enable},
                       "predicted_step_time_s": plan.predicted.step_time_s, "predicted_mfu": plan.predicted.mfu,
                       "predicted_peak_memory_bytes": plan.predicted.peak_memory_bytes,
                       "predicted_time_breakdown_s": dict(plan.predicted.time_breakdown),
                       "predicted_kinds_s": _predicted_kinds(result),
                       "model": str(model.relative_to(ROOT)), "parameters": plan.model.param_count}
        if name == "base":
            found["eager"] = _eager_twin(result)
        print(f"plan {name:9s} {found[name]['layout']} predicted {plan.predicted.step_time_s * 1e3:.1f} ms/step, "
              f"MFU {plan.predicted.mfu * 100:.1f}%, {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB "
              f"({found[name]['planned_in_s']:.0f} s to plan)")
    speedup = None
    if "base" in found:
        speedup = found["eager"]["predicted_step_time_s"] / found["base"]["predicted_step_time_s"]
        print(f"predicted compile speed-up (eager / compiled step time): {speedup:.3f}")
    _write(args.results, "plan", {"gpu": gpu, "model": str(MODELS[args.device].relative_to(ROOT)), "plans": found,
                                  "predicted_compile_speedup": speedup})


def _predicted_kinds(result) -> dict[str, float]:
    """The profile's op times (forward + backward) summed per cost kind and scaled from the profile's batch to a
    step (micro-batch x micro-batches, batch-linear), uncompiled: what the kernels of each kind should take."""
    from autoplan.chain.ops import cost_kind

    p = result.plan.parallelism
    scale = p.microbatch * p.microbatches / result.profile.batch_size
    kinds: dict[str, float] = {}
    for op in result.profile.ops:
        kind = cost_kind(op)
        kinds[kind] = kinds.get(kind, 0.0) + (op.time_fwd_s + op.time_bwd_s) * scale
    return kinds


def kernel_kind(name: str) -> str:
    """A kernel's cost kind by its name (KERNEL_KINDS)."""
    lower = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(word in lower for word in words):
            return kind
    return "memory"


def traced_kernels(trace: Path) -> dict:
    """A --profile trace's device time per kernel kind, per traced step (ProfilerStep spans), and its busiest
    kernels: {"steps", "kinds_s", "busy_s", "top"}."""
    events = json.loads(trace.read_text())["traceEvents"]
    steps = max(1, sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                       and e.get("cat") == "user_annotation"))
    kinds: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        seconds = float(e.get("dur", 0.0)) * 1e-6 / steps
        kind = kernel_kind(e["name"]) if e["cat"] == "kernel" else "memory"
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + seconds
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    return {"steps": steps, "kinds_s": kinds, "busy_s": sum(kinds.values()),
            "top": [{"name": n[:160], "kind": kernel_kind(n), "seconds_per_step": t} for n, t in top]}


def _eager_twin(result) -> dict:
    """The prediction of the chosen layout without compile: the search's candidate of the same parallelism with
    compile off (the search prices both)."""
    chosen = result.plan.parallelism
    twins = [c for c in result.candidates if c.parallelism == chosen and not c.compile and c.predicted is not None]
    if not twins:
        raise SystemExit("gpu_check: the search priced no compile=off twin of the chosen layout")
    twin = twins[0]
    return {"predicted_step_time_s": twin.predicted.step_time_s, "predicted_mfu": twin.predicted.mfu,
            "predicted_peak_memory_bytes": twin.predicted.peak_memory_bytes, "fits": twin.fits}


def cmd_train(args) -> None:
    """Train one plan on one device (verify.train_and_measure: torchrun, --metrics-out), recompiles counted."""
    import os

    from autoplan.plan import load_plan
    from autoplan.verify import VerifySettings, train_and_measure

    folder = args.results / "plans" / args.plan
    plan = load_plan(folder / "plan.json")
    traces = args.results / "traces" / args.run
    extra = (("--no-compile",) if args.no_compile else ()) + (("--profile", str(traces)) if args.profile else ())
    env = {"TORCH_LOGS": "recompiles", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1)))}
    run = train_and_measure(folder, plan, VerifySettings(1, args.steps, args.timeout, device=args.device), extra, env)
    m = run.measured
    recompiles = len(RECOMPILES.findall(run.stderr))
    compiled = plan.compile.enable and not args.no_compile
    first_s = run.steps[0]["seconds"] if run.steps else None
    data = {"plan": args.plan, "compiled": compiled, "steps": args.steps, "losses": list(run.losses),
            "first_step_s": first_s, "recompiles": recompiles,
            **{k: m.get(k) for k in ("measured_step_time_s", "predicted_step_time_s", "measured_peak_memory_bytes",
                                     "predicted_peak_memory_bytes", "measured_mfu", "predicted_mfu")},
            "per_step_peak_memory_bytes": [s.get("peak_memory_bytes") for s in run.steps],
            "per_step_peak_reserved_bytes": [s.get("peak_reserved_bytes") for s in run.steps],
            "per_step_seconds": [s.get("seconds") for s in run.steps]}
    later = run.steps[1:]  # the first holds compilation and the allocator's growth
    if later and later[-1].get("peak_reserved_bytes") is not None:
        data["measured_peak_reserved_bytes"] = statistics.median(s["peak_reserved_bytes"] for s in later)
        data["measured_peak_allocated_bytes_per_step"] = statistics.median(s["peak_memory_bytes"] for s in later)
    if args.profile:  # the traced last steps run slower: time the steps between the first and them
        from autoplan.runtime.components.profiling import PROFILED_STEPS

        untraced = [s["seconds"] for s in run.steps[1:-PROFILED_STEPS]]
        if untraced:
            data["measured_step_time_s"] = statistics.median(untraced)
        kernels = traced_kernels(traces / "rank0.trace.json")
        predicted = json.loads((args.results / "plan.json").read_text())["plans"][args.plan]["predicted_kinds_s"]
        data["kernels"] = {**kernels, "predicted_kinds_s": predicted}
        for kind in sorted(set(kernels["kinds_s"]) | set(predicted) - {"view"}):
            got, want = kernels["kinds_s"].get(kind, 0.0), predicted.get(kind, 0.0)
            print(f"kernels {args.run} {kind:10s} {got * 1e3:8.2f} ms/step traced, {want * 1e3:8.2f} priced "
                  f"(uncompiled, batch-linear): {_ratio(got, want)}")
        print(f"kernels {args.run}: device busy {kernels['busy_s'] * 1e3:.2f} ms of a "
              f"{data['measured_step_time_s'] * 1e3:.2f} ms step; busiest: "
              + "; ".join(f"{k['name'][:60]} {k['seconds_per_step'] * 1e3:.2f} ms" for k in kernels["top"][:5]))
    if not compiled and args.plan == "base":  # the eager run is priced by the compile=off twin of the layout
        eager = json.loads((args.results / "plan.json").read_text())["plans"]["eager"]
        data.update({k: eager[k] for k in ("predicted_step_time_s", "predicted_peak_memory_bytes")})
        if data.get("measured_mfu") is not None:  # the same FLOPs over the measured time: only the prediction differs
            data["predicted_mfu"] = eager["predicted_mfu"]
    _write(args.results, f"train_{args.run}", data)
    mfu = f", MFU {data['measured_mfu'] * 100:.1f}%" if data.get("measured_mfu") is not None else ""
    if data.get("measured_peak_reserved_bytes"):
        mfu += (f", reserved {data['measured_peak_reserved_bytes'] / 2**30:.2f} GiB (reserved / predicted "
                f"{_ratio(data['measured_peak_reserved_bytes'], data['predicted_peak_memory_bytes'])})")
    print(f"train {args.run}: {data['measured_step_time_s'] * 1e3:.1f} ms/step (measured / predicted "
          f"{_ratio(data['measured_step_time_s'], data['predicted_step_time_s'])}){mfu}, peak "
          f"{data['measured_peak_memory_bytes'] / 2**30:.2f} GiB (measured / predicted "
          f"{_ratio(data['measured_peak_memory_bytes'], data['predicted_peak_memory_bytes'])}), first step "
          f"{first_s:.1f} s, {recompiles} recompiles, losses {run.losses[0]:.3f} -> {run.losses[-1]:.3f}")


def cmd_calibrate(args) -> None:
    """autoplan calibrate on one rank (the single-device probes) against the packaged profile's values."""
    from autoplan.calibrate import calibrate
    from autoplan.hardware.profiles import load_hardware

    gpu = profile_name(args.device)
    base = load_hardware(gpu)
    out = args.results / "calibrated.yaml"
    calibrate(out, nproc=1, base=gpu, timeout_s=args.timeout)
    import yaml

    raw = yaml.safe_load(out.read_text())["measurements"]
    primary = "bf16" if args.device == "cuda" else "fp32"
    gemm = max(raw["matmul_tflops"][primary].values()) * 1e12
    bandwidth = max(raw["copy_gb_per_s"].values()) * 1e9
    launch = raw["kernel_overhead_us"] * 1e-6
    g = base.gpu
    rows = {"gemm_flops_per_s": (gemm, g.peak_flops[primary] * g.matmul_efficiency),
            "memory_bytes_per_s": (bandwidth, g.memory_bandwidth_bytes_per_s * g.memory_efficiency),
            "kernel_overhead_s": (launch, g.kernel_overhead_s)}
    for name, (measured, profiled) in rows.items():
        print(f"calibrate {name}: measured {measured:.4g}, profile {profiled:.4g} "
              f"(measured / profile {_ratio(measured, profiled)})")
    _write(args.results, "calibrate", {"profile": gpu, "dtype": primary, "calibrated_profile": out.name,
                                       **{k: {"measured": m, "profile": p} for k, (m, p) in rows.items()}})


def cmd_offload(args) -> None:
    """FSDP2 with CPU offload (pinned host memory on a GPU) on a one-rank mesh: a few AdamW steps of the model's
    shrunken copy; the parameters must stay on the host (pinned) and the loss must fall."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from autoplan.runtime.components.optimizer import adamw
    from autoplan.contract import load_source

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    try:
        source = load_source(f"{MODELS['cpu']}:build_model")
        torch.manual_seed(0)
        model = source.build_model()
        mesh = init_device_mesh(device.type, (1,))
        policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=cuda),
                      **({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)} if cuda else {}))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        optimizer = adamw(model.parameters(), 1e-3, "foreach")
        inputs, targets = source.example_batch(4)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        targets = targets.to(device)
        losses, times = [], []
        for _ in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = source.loss_fn(model(**inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - started)
        local = [p.to_local() for p in model.parameters()]
        on_host = all(t.device.type == "cpu" for t in local)
        pinned = all(t.is_pinned() for t in local) if cuda else None
    finally:
        dist.destroy_process_group()
    ok = on_host and (pinned is not False) and losses[-1] < losses[0]
    print(f"offload: FSDP2 + CPUOffloadPolicy(pin_memory={cuda}) on 1 rank: parameters on the host {on_host}, "
          f"pinned {pinned}, losses {losses[0]:.3f} -> {losses[-1]:.3f}, median step "
          f"{statistics.median(times) * 1e3:.1f} ms: {'PASS' if ok else 'FAIL'}")
    _write(args.results, "offload", {"parameters_on_host": on_host, "pinned": pinned, "losses": losses,
                                     "step_times_s": times, "passed": ok})
    if not ok:
        raise SystemExit(1)


def cmd_checkpoint(args) -> None:
    """A DCP save after 2 steps and a resume to 4 (train.py --checkpoint-dir, --resume) against 4 steps straight:
    the resumed steps' losses match the straight run's (up to the device's nondeterminism)."""
    import tempfile

    from autoplan.api import PlanOptions, plan_model
    from autoplan.runtime.harness.hooks import verify_environment
    from autoplan.verify import VerifySettings, run_train_py

    gpu = profile_name(args.device)
    folder = args.results / "plans" / "checkpoint"
    plan_model(str(MODELS["cpu"]), 1, gpu,
               PlanOptions(out=folder))  # the shrunken model: the save is the point, not its size

    def losses(name: str, *extra: str) -> list[float]:
        out = folder / f"losses_{name}.json"
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            run_train_py(folder, VerifySettings(1, timeout_s=args.timeout, device=args.device),
                         (*extra, "--losses-out", str(out)), verify_environment(None), Path(tmp))  # dropout off, as under autoplan verify
        return json.loads(out.read_text())

    straight = losses("straight", "--steps", "4")
    checkpoints = folder / "checkpoints"
    losses("saved", "--steps", "2", "--decay-steps", "4", "--checkpoint-dir", str(checkpoints))
    resumed = losses("resumed", "--steps", "4", "--checkpoint-dir", str(checkpoints), "--resume")
    tolerance = 1e-2 if args.device == "cuda" else 1e-5  # bf16 kernels need not be bitwise repeatable
    diff = max(abs(a - b) for a, b in zip(resumed, straight[-len(resumed):]))
    ok = len(resumed) == 2 and diff <= tolerance
    print(f"checkpoint: DCP save at step 2, resume to 4: losses {resumed} vs straight {straight[2:]}, max |diff| "
          f"{diff:.3g} (limit {tolerance:g}): {'PASS' if ok else 'FAIL'}")
    _write(args.results, "checkpoint", {"straight": straight, "resumed": resumed, "max_abs_diff": diff,
                                        "tolerance": tolerance, "passed": ok})
    if not ok:
        raise SystemExit(1)


def cmd_profile(args) -> None:
    """profile --measure (ops timed here, in the plan's dtype) against the roofline of this machine's profile,
    summed per op kind (chain.ops.cost_kind)."""
    from autoplan.api import ProfileOptions, profile_only
    from autoplan.chain.ops import cost_kind

    gpu = profile_name(args.device)
    model = str(MODELS[args.device])
    measured = profile_only(model, gpu, ProfileOptions(measure=True, out=args.results / "profile_measured"))
    roofline = profile_only(model, gpu, ProfileOptions(measure=False))
    kinds: dict[str, dict[str, float]] = {}
    for i, op in enumerate(measured.ops):
        row = kinds.setdefault(cost_kind(op), {"ops": 0, "measured_s": 0.0, "roofline_s": 0.0, "timed": 0})
        row["ops"] += 1
        row["timed"] += op.source == "measured"
        row["measured_s"] += op.time_fwd_s + op.time_bwd_s
        other = roofline.ops[i]
        row["roofline_s"] += other.time_fwd_s + other.time_bwd_s
    for kind, row in sorted(kinds.items()):
        print(f"profile {kind:9s} {row['ops']:4d} ops ({row['timed']} timed): measured {row['measured_s'] * 1e3:.2f} ms, "
              f"roofline {row['roofline_s'] * 1e3:.2f} ms (measured / roofline "
              f"{_ratio(row['measured_s'], row['roofline_s'])})")
    _write(args.results, "profile", {"profile": gpu, "batch_size": measured.batch_size, "by_kind": kinds})


def cmd_summary(args) -> None:
    """Every ratio the steps wrote, in one table (what gpu_check.sh prints last)."""
    results = args.results
    rows = []

    def load(name: str) -> dict | None:
        path = results / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    plan = load("plan")
    for run in ("compile", "eager", "selective", "full", "moe", "moe_compiled", "long"):
        data = load(f"train_{run}")
        if data is None:
            rows.append((f"train {run}", "not run (or failed): see the log above"))
            continue
        rows.append((f"train {run} step time", _ratio(data["measured_step_time_s"], data["predicted_step_time_s"])))
        rows.append((f"train {run} peak memory", _ratio(data["measured_peak_memory_bytes"],
                                                        data["predicted_peak_memory_bytes"])))
        if data.get("measured_mfu") is not None:
            rows.append((f"train {run} MFU", _ratio(data["measured_mfu"], data["predicted_mfu"])))
        rows.append((f"train {run} recompiles", str(data["recompiles"])))
        if data.get("measured_peak_reserved_bytes"):
            rows.append((f"train {run} reserved memory", _ratio(data["measured_peak_reserved_bytes"],
                                                                data["predicted_peak_memory_bytes"])))
        for kind, got in sorted(data.get("kernels", {}).get("kinds_s", {}).items()):
            rows.append((f"train {run} {kind} kernels / priced",
                         _ratio(got, data["kernels"]["predicted_kinds_s"].get(kind))))
    compiled, eager = load("train_compile"), load("train_eager")
    if compiled and eager and plan and plan.get("predicted_compile_speedup"):
        measured = eager["measured_step_time_s"] / compiled["measured_step_time_s"]
        rows.append(("compile speed-up (measured / predicted)",
                     f"{measured:.3f} / {plan['predicted_compile_speedup']:.3f} = "
                     f"{measured / plan['predicted_compile_speedup']:.3f}"))
    calibrated = load("calibrate")
    if calibrated:
        for key in ("gemm_flops_per_s", "memory_bytes_per_s", "kernel_overhead_s"):
            rows.append((f"calibrate {key}", _ratio(calibrated[key]["measured"], calibrated[key]["profile"])))
    for name in ("offload", "checkpoint"):
        data = load(name)
        rows.append((name, "not run (or failed)" if data is None else ("PASS" if data["passed"] else "FAIL")))
    profiled = load("profile")
    if profiled:
        for kind, row in sorted(profiled["by_kind"].items()):
            rows.append((f"profile {kind} measured / roofline", _ratio(row["measured_s"], row["roofline_s"])))
    width = max(len(name) for name, _ in rows)
    print("measured / predicted (1.000 = as predicted):")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    _write(results, "summary", {name: value for name, value in rows})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("detect", "plan", "train", "calibrate", "offload", "checkpoint", "profile",
                                         "summary"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    parser.add_argument("--plan", default="base", choices=tuple(PLANS))
    parser.add_argument("--run", default="compile")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--profile", action="store_true", help="trace the last steps (train.py --profile) and sum "
                        "their kernels per cost kind against the prediction")
    parser.add_argument("--plans", default=",".join(PLANS), help="the plans the plan step makes (comma-separated)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the step's own subprocesses")
    args = parser.parse_args(argv)
    {"detect": cmd_detect, "plan": cmd_plan, "train": cmd_train, "calibrate": cmd_calibrate, "offload": cmd_offload,
     "checkpoint": cmd_checkpoint, "profile": cmd_profile, "summary": cmd_summary}[args.step](args)


if __name__ == "__main__":
    main()
