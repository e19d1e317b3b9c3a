"""Close the loop on this machine: calibrate, plan, run, and compare the prediction with the measurement.

    python benchmarks/predicted_vs_measured.py [--hardware PROFILE.yaml] [--model examples/gpt.py]
                                               [--layouts dp,fsdp,pp,tp] [--steps 16] [--repeats 3]
                                               [--keep DIR]

1. `autoplan calibrate` with 2 gloo ranks (skipped with --hardware): matmul, copy, tiny-op, DTensor and
   optimizer overheads, collectives per operation, compute/communication overlap.
2. Trials: for each layout, `autoplan MODEL --gpus 2 --gpu cpu --hardware PROFILE --pin LAYOUT` (a small
   GPT, global batch 16; op and whole-model timings taken afresh, its own timing cache) and right after it
   `autoplan verify --measure`: loss parity, then per rank the median step time (warm-up and
   memory-tracked steps left out) and the peak of live tensor storage bytes of a step. That is what a
   user does: plan, then run. --repeats trials per layout, the layouts taking turns, so a slow spell of
   a shared VM hits every layout; every trial's error is printed, and the trial with the median error.
3. Prints predicted vs measured step time and peak memory with their errors (predicted / measured - 1)
   against issue 7's bounds: step time within 30%, peak memory within 15%.

Run it on a quiet machine: the measured step times are wall-clock times of two processes on two cores.
The whole model's forward+backward is timed before and after all trials: the ratio shows how much the
machine drifted (on this project's VM, 25-40% within one run of this benchmark happened).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "dp": "dp=2,zero=0",    # DDP: replicated model, gradient all-reduce
    "fsdp": "dp=2,zero=3",  # FSDP2: sharded parameters, all-gather / reduce-scatter per unit
    "pp": "pp=2",           # two pipeline stages (the solver picks schedule and micro-batches)
    "tp": "tp=2",           # Megatron-style tensor parallel on the attention and MLP Linears
}
TIME_BOUND = 0.30
"""Largest |predicted / measured - 1| of the step time that issue 7 accepts."""
MEMORY_BOUND = 0.15
"""The same for the peak memory."""


def autoplan(*args: str, cache: Path) -> None:
    """Run the autoplan CLI with its op-timing cache in `cache`; stop with its stderr if it fails."""
    env = {**os.environ, "AUTOPLAN_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"autoplan {' '.join(args)} failed:\n{done.stderr}")


def whole_model_seconds(model: str) -> float:
    """The real model's forward+backward at batch 8 on one thread (autoplan.profile.whole_model)."""
    from autoplan.profile.whole_model import time_whole_model
    from autoplan.contract import load_source

    return time_whole_model(load_source(model), parameter_bytes=0.0)[8]


def median_trial(trials: list[dict]) -> dict:
    """The trial whose step-time error is the median (the upper one of an even count), with every
    trial's error and whether every trial passed parity."""
    ordered = sorted(trials, key=lambda v: v["step_time_error"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["errors"] = [v["step_time_error"] for v in trials]
    chosen["passed"] = all(v["passed"] for v in trials)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", type=Path, help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--model", default=str(ROOT / "examples" / "gpt.py"))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--global-batch", type=int, default=16)
    # 16: with 8 steps, three back-to-back verify runs of one DP program measured 88, 101 and 121 ms here;
    # with 24, 81-88 ms
    parser.add_argument("--steps", type=int, default=16, help="steps per verify run (first and last not timed)")
    parser.add_argument("--repeats", type=int, default=3, help="plan + verify trials per layout (the median error is kept)")
    parser.add_argument("--keep", type=Path, help="keep the profile and output folders here")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        sys.exit(f"unknown layout {unknown[0]!r}: use {', '.join(LAYOUTS)}")

    drift = [whole_model_seconds(args.model)]
    work = args.keep or Path(tempfile.mkdtemp(prefix="autoplan-pvm-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hardware = args.hardware
        if hardware is None:
            hardware = work / "calibrated.yaml"
            started = time.perf_counter()
            autoplan("calibrate", "--out", str(hardware), "--nproc", "2", cache=work / "cache-calibrate")
            print(f"calibrated 2 gloo ranks in {time.perf_counter() - started:.0f} s -> {hardware}")
        trials: dict[str, list[dict]] = {name: [] for name in layouts}
        for _ in range(max(1, args.repeats)):
            for name in layouts:
                out, cache = work / name, work / f"cache-{name}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True)  # timings taken now, right before the run they predict
                autoplan(args.model, "--gpus", "2", "--gpu", "cpu", "--hardware", str(hardware),
                         "--pin", LAYOUTS[name], "--global-batch", str(args.global_batch), "--out", str(out),
                         "--quiet", cache=cache)
                autoplan("verify", str(out), "--measure", "--steps", str(args.steps), cache=cache)
                trial = json.loads((out / "verify.json").read_text())
                trial["parallelism"] = json.loads((out / "plan.json").read_text())["parallelism"]
                trials[name].append(trial)
        rows = [(name, median_trial(trials[name])) for name in layouts]
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    drift.append(whole_model_seconds(args.model))
    print(f"\n{'layout':<6} {'schedule':<22} {'parity':>8} {'step pred':>10} {'measured':>9} {'error':>7} "
          f"{'every trial':>22}   {'memory pred':>11} {'measured':>9} {'error':>7}")
    failures, trials_inside, trials_all = 0, 0, 0
    for name, v in rows:
        par = v["parallelism"]
        shape = (f"m={par['pipeline_parallel_num_microbatches']}x{par['pipeline_parallel_microbatch_size']}"
                 + (f" {par['pipeline_parallel_schedule']}" if par["pipeline_parallel_degree"] > 1 else ""))
        time_error, memory_error = v["step_time_error"], v["peak_memory_error"]
        ok = abs(time_error) <= TIME_BOUND and abs(memory_error) <= MEMORY_BOUND and v["passed"]
        failures += not ok
        trials_inside += sum(abs(e) <= TIME_BOUND for e in v["errors"])
        trials_all += len(v["errors"])
        every = "/".join(f"{e:+.0%}" for e in v["errors"])
        print(f"{name:<6} {shape:<22} {v['parity_max_abs_diff']:>8.1e} "
              f"{v['predicted_step_time_s'] * 1e3:>8.1f}ms {v['measured_step_time_s'] * 1e3:>7.1f}ms "
              f"{time_error:>+7.1%} {every:>22}   "
              f"{v['predicted_peak_memory_bytes'] / 2**20:>9.2f}MiB "
              f"{v['measured_peak_memory_bytes'] / 2**20:>7.2f}MiB {memory_error:>+7.1%}  {'ok' if ok else 'OUT OF BOUNDS'}")
    print(f"\nbounds: step time within {TIME_BOUND:.0%}, peak memory within {MEMORY_BOUND:.0%}; "
          f"{len(rows) - failures}/{len(rows)} layouts inside (median trial); "
          f"{trials_inside}/{trials_all} trials' step times inside")
    print(f"machine drift: the whole model's forward+backward at batch 8 took {drift[0] * 1e3:.1f} ms before the "
          f"layouts and {drift[1] * 1e3:.1f} ms after ({drift[1] / drift[0] - 1:+.0%})")


if __name__ == "__main__":
    main()
