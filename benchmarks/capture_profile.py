"""Capture + profile + plan time and peak memory for Llama configs from 1B to 405B parameters, and how
many example models torch.export captures without a fallback.

    python benchmarks/capture_profile.py              all cases, each in a fresh process
    python benchmarks/capture_profile.py --case 70b   one case in this process (prints one JSON line)

Every case builds the model on fake tensors (nothing is allocated) from examples/llama.py at the
published shapes, at 4096 tokens per sample, and plans it for H100s. The issue's bound: the 70B case
in at most 60 s and 4 GiB peak RSS on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

LLAMA = {
    # name: (layers, hidden, intermediate, heads, kv heads, GPUs to plan for); Llama 3.x model cards
    "1b": (16, 2048, 8192, 32, 8, 8),
    "8b": (32, 4096, 14336, 32, 8, 8),
    "70b": (80, 8192, 28672, 64, 8, 64),
    "405b": (126, 16384, 53248, 128, 8, 256),
}
VOCAB = 128256
SEQ_LEN = 4096
BOUND_70B_SECONDS = 60.0
BOUND_70B_RSS_GIB = 4.0


def run_case(name: str) -> dict:
    """Plan one Llama config in this process; stage times in seconds, peak RSS in GiB."""
    started = time.perf_counter()
    import autoplan.profile.model_profile as model_profile
    from autoplan.api import plan_model
    from autoplan.capture import capture_model
    from autoplan.errors import UserError
    from autoplan.contract import load_source

    source = load_source(str(EXAMPLES / "llama.py"))
    layers, hidden, intermediate, heads, kv_heads, gpus = LLAMA[name]
    for constant, value in dict(LAYERS=layers, HIDDEN=hidden, INTERMEDIATE=intermediate, HEADS=heads,
                                KV_HEADS=kv_heads, VOCAB=VOCAB, SEQ_LEN=SEQ_LEN).items():
        setattr(source.module, constant, value)
    stages = {"import_s": time.perf_counter() - started}

    def timed_profile_model(source, batch_size, hardware, measure, dtype="fp32", capture_method="auto"):
        begin = time.perf_counter()
        graph = capture_model(source, batch_size, capture_method)
        stages["capture_s"] = time.perf_counter() - begin
        begin = time.perf_counter()
        profile = model_profile.profile_graph(graph, source.spec, batch_size, hardware, measure, dtype)
        stages["profile_s"] = time.perf_counter() - begin
        stages.update(ops=len(profile.ops), parameters=profile.param_count, method=profile.capture_method)
        return profile

    model_profile.profile_model = timed_profile_model  # plan_model looks it up at call time
    begin = time.perf_counter()
    try:
        result = plan_model(source, gpus, "h100-sxm5-80gb")
        p = result.plan.parallelism
        stages["plan"] = (f"dp={p.dp} tp={p.tp} pp={p.pp} "
                          f"recompute={p.recompute}, {result.plan.predicted.step_time_s:.2f} s/step")
    except UserError as e:
        stages["plan"] = f"no plan: {str(e)[:120]}"
    stages["search_s"] = time.perf_counter() - begin - stages.get("capture_s", 0) - stages.get("profile_s", 0)
    stages["total_s"] = time.perf_counter() - started
    stages["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB
    stages.update(case=name, gpus=gpus)
    return stages


def count_exported() -> tuple[int, list[str]]:
    """Example models (default configs) that torch.export captures without falling back."""
    from autoplan.capture import capture_model
    from autoplan.contract import load_source

    lines, exported = [], 0
    files = sorted(EXAMPLES.glob("*.py"))
    for path in files:
        begin = time.perf_counter()
        graph = capture_model(load_source(str(path)), 2)
        ok = graph.method == "export" and not graph.failures
        exported += ok
        lines.append(f"  {path.name:<12} {graph.method:<15} {len(graph.nodes):>6} ops  "
                     f"{time.perf_counter() - begin:5.1f} s{'' if ok else '  ' + '; '.join(graph.failures)}")
    return exported, [f"{exported} of {len(files)} example models captured by torch.export:"] + lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(LLAMA), help="run one case in this process")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'case':<6}{'GPUs':>5}{'import':>8}{'capture':>9}{'profile':>9}{'search':>8}{'total':>8}{'RSS GiB':>9}"
          f"{'ops':>7}  plan")
    within_bounds = True
    for name in LLAMA:
        done = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last_line = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            print(f"{name:<6} failed: {last_line}")
            within_bounds = False
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name:<6}{r['gpus']:>5}{r['import_s']:>8.1f}{r.get('capture_s', 0):>9.1f}{r.get('profile_s', 0):>9.1f}"
              f"{r['search_s']:>8.1f}{r['total_s']:>8.1f}{r['peak_rss_gib']:>9.2f}{r.get('ops', 0):>7}  {r['plan']}")
        if name == "70b":
            within_bounds = r["total_s"] <= BOUND_70B_SECONDS and r["peak_rss_gib"] <= BOUND_70B_RSS_GIB
    verdict = "met" if within_bounds else "NOT met"
    print(f"70B bound ({BOUND_70B_SECONDS:.0f} s, {BOUND_70B_RSS_GIB:.0f} GiB): {verdict}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("\n".join(count_exported()[1]))
    return 0 if within_bounds else 1


if __name__ == "__main__":
    sys.exit(main())
