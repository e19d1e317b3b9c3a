"""Planning time across 12..128 layers and 8..4096 GPUs, and how it grows.

    python benchmarks/planning_time.py [--quick] [--skip-capture] [--cli-only]

Each cell is one full search (autoplan.solve.search.search: every degree, ZeRO stage, HSDP split,
schedule, virtual stages, micro-batch size and recompute mode, then the MILP on the winner) for a
GPT of that depth on A100 80GB nodes of 8, bf16, global batch max(512, GPUs) sequences of 2048 tokens.
Profiles come from the GPT profile generator (the same numbers capture gives, tests/chain_fixtures.py);
the last part times the real capture path (plan_model: torch.export on fake tensors + profile + search)
for the 1.7B GPT of examples/gpt.py, the 1T GPT on 3072 GPUs against its published layout, and the whole
`autoplan` command for that 1T GPT (benchmarks/models/megatron_gpt.py at the published shape: start-up,
capture + profile, search, the rest of the scaling curve, report and program writing) against CLI_BOUND_S. The context- and
expert-parallel searches (issue 19; `--cp-ep` alone) time Llama-3.1-8B at 131,072 tokens with cp among the
features and Mixtral-8x7B at 4,096 with ep, both captured on fake tensors, on 8..512 H100s against CP_EP_BOUND_S.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the GPT profile generator lives with the tests

from chain_fixtures import a100_cluster, gpt_profile, read_runs, run_cluster, run_pins, run_profile  # noqa: E402

from autoplan.layout import ALL_FEATURES  # noqa: E402
from autoplan.plan import Training  # noqa: E402
from autoplan.solve import layouts  # noqa: E402
from autoplan.solve.pins import parse_pins  # noqa: E402
from autoplan.solve.search import SearchOptions, search  # noqa: E402

SHAPES = {12: (768, 12), 24: (2304, 24), 48: (8192, 64), 96: (12288, 96), 128: (25600, 160)}
"""Layers -> (hidden, heads): GPT-3 / Megatron-LM family shapes."""
GPU_COUNTS = (8, 64, 512, 4096)
CP_EP_BOUND_S = 10.0
"""One search with context or expert parallelism among the features, 8..512 GPUs, seconds (issue 19)."""
CP_EP_GPU_COUNTS = (8, 64, 512)
BIG_BOUND_S = 60.0
"""Planning one of the big models through the CLI, seconds (issue 28)."""
BIG_BOUND_RSS_BYTES = 2 * 2**30
"""Peak resident memory of that run (issue 28)."""
BIG_MODELS = (("DeepSeek-V3-671B", "deepseek_v3_671b", 4096, 1024, 4096),
              ("Qwen3-235B-A22B", "qwen3_235b_a22b", 4096, 256, 1024),
              ("Llama-3.1-405B", "llama31_405b", 131_072, 512, 16))
"""(name, benchmarks/models file, tokens per sequence, H100s, global batch in sequences)."""
CLI_BOUND_S = 10.0
"""The whole `autoplan` run for the 1T GPT on 3072 A100s, seconds, on a 2-core machine."""


def plan_once(layers: int, gpus: int) -> tuple[float, int, str]:
    hidden, heads = SHAPES[layers]
    profile = gpt_profile(n_layer=layers, n_embd=hidden, vocab=51200, seq=2048, batch=2, n_head=heads,
                          device="a100-sxm4-80gb", attention="megatron")
    started = time.perf_counter()
    try:
        result = search(profile, a100_cluster(gpus), Training(global_batch_size=max(512, gpus), dtype="bf16"))
    except Exception as e:  # noqa: BLE001 - a cell that cannot be planned is reported, not fatal
        return time.perf_counter() - started, 0, f"({type(e).__name__})"
    return time.perf_counter() - started, result.solver.candidates_evaluated, layouts.describe(result.best.parallelism)


def growth(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x): planning time ~ x^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def grid(layer_counts, gpu_counts) -> None:
    print("## Full search time, seconds (layouts considered)")
    print(f"{'layers':>6} " + " ".join(f"{g:>16}" for g in gpu_counts))
    times: dict[tuple[int, int], float] = {}
    chosen = []
    for layers in layer_counts:
        cells = []
        for gpus in gpu_counts:
            seconds, considered, layout = plan_once(layers, gpus)
            times[layers, gpus] = seconds
            cells.append(f"{seconds:7.2f} ({considered:>6})" if considered else f"{seconds:7.2f} (no fit)")
            chosen.append(f"  {layers} layers, {gpus} GPUs: {layout}")
        print(f"{layers:>6} " + " ".join(f"{c:>16}" for c in cells))
    by_gpus = growth(list(gpu_counts), [sum(times[l, g] for l in layer_counts) for g in gpu_counts])
    by_layers = growth(list(layer_counts), [sum(times[l, g] for g in gpu_counts) for l in layer_counts])
    print(f"growth: time ~ GPUs^{by_gpus:.2f} and ~ layers^{by_layers:.2f}")
    print("chosen layouts:")
    print("\n".join(chosen))


MODEL_FILE = '''import sys
import torch
sys.path.insert(0, {folder!r})
from gpt import GPT, loss_fn

def build_model():
    return GPT(51200, 2048, 24, 24, 2304)

def example_batch(batch_size):
    idx = torch.randint(0, 51200, (batch_size, 2049))
    return idx[:, :-1], idx[:, 1:]
'''


def capture_path() -> None:
    from autoplan.api import PlanOptions, plan_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt_1p7b.py"
        path.write_text(MODEL_FILE.format(folder=str(ROOT / "examples")))
        started = time.perf_counter()
        plan = plan_model(str(path), 32, "a100-sxm4-80gb", PlanOptions(global_batch=512)).plan
        print(f"\n## Real capture path: examples/gpt.py 1.7B (24 x 2304) on 32 A100s: "
              f"{time.perf_counter() - started:.1f} s end to end (capture, profile, search), "
              f"{plan.solver.candidates_evaluated} layouts, chose {layouts.describe(plan.parallelism)}")


def one_trillion_row() -> dict[str, str]:
    runs = ROOT.parent / "shared" / "reference" / "runs.csv"
    if not runs.is_file():
        runs = ROOT / "tests" / "fixtures" / "published_runs.csv"
    return next(r for r in read_runs(runs) if r["pp"] == "64")


def one_trillion() -> None:
    row = one_trillion_row()
    profile, cluster = run_profile(row), run_cluster(row)
    training = Training(global_batch_size=int(row["global_batch_seqs"]), dtype="bf16")
    started = time.perf_counter()
    result = search(profile, cluster, training,
                    options=SearchOptions(features=ALL_FEATURES))  # priced as Megatron-LM could run it
    elapsed = time.perf_counter() - started
    published = search(profile, cluster, training, parse_pins(run_pins(row)),
                       options=SearchOptions(features=ALL_FEATURES)).best
    best = result.best.predicted.step_time_s
    print(f"\n## 1T GPT (128 x 25600, 160 heads) on 3072 A100s: full search {elapsed:.1f} s, "
          f"{result.solver.candidates_evaluated} layouts considered, MILP {result.solver.status}")
    print(f"chosen   {layouts.describe(result.best.parallelism)}: {best:.1f} s/step, "
          f"{result.best.predicted.peak_memory_bytes / 2**30:.1f} GiB")
    print(f"published {layouts.describe(published.parallelism)}: {published.predicted.step_time_s:.1f} s/step "
          f"(chosen is {100 * (1 - best / published.predicted.step_time_s):.1f}% faster)")


MEGATRON_FILE = '''import sys
sys.path.insert(0, {folder!r})
import megatron_gpt
megatron_gpt.N_LAYER, megatron_gpt.N_HEAD, megatron_gpt.N_EMBD = {layers}, {heads}, {hidden}
megatron_gpt.SEQ_LEN, megatron_gpt.VOCAB = {seq}, {vocab}
from megatron_gpt import GPT, example_batch, loss_fn

def build_model():
    return GPT()
'''
PHASES = (("capture + profile", "start-up (imports)"), ("search ", "capture + profile"),
          ("scaling curve", "search"), ("planned in", "scaling curve (what is left of its second process)"),
          ("writing", "-"))
"""(log line prefix after "autoplan: ", the phase that line ends): the CLI logs each phase as it starts. The scaling
curve's other GPU counts are searched in a second process during the search: its phase is the wait for the rest."""


def whole_cli() -> None:
    """`autoplan MODEL.py --gpus 3072 --gpu a100-sxm4-80gb --global-batch 3072` for the 1T GPT as a user runs
    it, in a fresh process; phases are timed by when the CLI's log lines arrive."""
    row = one_trillion_row()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt_1t.py"
        path.write_text(MEGATRON_FILE.format(folder=str(ROOT / "benchmarks" / "models"), layers=row["layers"],
                                             heads=row["heads"], hidden=row["hidden"], seq=row["seq_len"],
                                             vocab=row["vocab"]))
        command = [sys.executable, "-m", "autoplan", str(path), "--gpus", row["gpus"], "--gpu", row["gpu"],
                   "--gpus-per-node", row["gpus_per_node"], "--global-batch", row["global_batch_seqs"],
                   "--out", str(Path(tmp) / "out")]
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        marks, last = [], started
        for line in proc.stderr:
            message = line.removeprefix("autoplan: ")
            for prefix, ended in PHASES:
                if message.startswith(prefix) and ended != "-":
                    now = time.perf_counter()
                    marks.append((ended, now - last))
                    last = now
        code = proc.wait()
        total = time.perf_counter() - started
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    if code != 0:
        print(f"\n## Whole CLI run, 1T GPT on {row['gpus']} A100s: exit {code} after {total:.1f} s")
        return
    marks.append(("report + program writing, exit", total - (last - started)))
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in marks)
    verdict = "within" if total <= CLI_BOUND_S else "OVER"
    print(f"\n## Whole CLI run, 1T GPT (128 x 25600) on {row['gpus']} A100s: {total:.1f} s end to end "
          f"({verdict} the {CLI_BOUND_S:g} s bound), {cpu:.1f} s CPU (a busy machine shows in the difference; "
          f"load average {os.getloadavg()[0]:.1f})\n{phases}")


def context_and_expert() -> None:
    """Searches with cp (Llama-3.1-8B, 131,072 tokens) and ep (Mixtral-8x7B, 4,096 tokens) among the features."""
    from autoplan.capture import capture_model
    from autoplan.hardware.profiles import load_hardware
    from autoplan.hardware.types import Cluster
    from autoplan.layout import SUPPORTED
    from autoplan.profile import profile_graph
    from autoplan.contract import load_source

    h100 = load_hardware("h100-sxm5-80gb")
    models = (("Llama-3.1-8B", "llama", 131_072, {"cp"}, 8,
               dict(VOCAB=128256, HIDDEN=4096, INTERMEDIATE=14336, LAYERS=32, HEADS=32, KV_HEADS=8)),
              ("Mixtral-8x7B", "mixtral", 4096, {"ep"}, 256,
               dict(VOCAB=32000, HIDDEN=4096, INTERMEDIATE=14336, LAYERS=32, HEADS=32, KV_HEADS=8, EXPERTS=8,
                    EXPERTS_PER_TOKEN=2)))
    print(f"\n## Context- and expert-parallel searches on H100s (bound {CP_EP_BOUND_S:g} s each)")
    for name, example, seq, feature, batch, shapes in models:
        source = load_source(str(ROOT / "examples" / f"{example}.py"))
        for constant, value in {**shapes, "SEQ_LEN": seq}.items():
            setattr(source.module, constant, value)
        started = time.perf_counter()
        profile = profile_graph(capture_model(source, 1), source.spec, 1, h100, measure=False, dtype="bf16")
        print(f"{name} at {seq} tokens: captured on fake tensors in {time.perf_counter() - started:.1f} s")
        for gpus in CP_EP_GPU_COUNTS:
            training = Training(global_batch_size=max(batch, gpus), dtype="bf16", tokens_per_sample=seq)
            started = time.perf_counter()
            try:
                result = search(profile, Cluster(h100, gpus, 8), training,
                                options=SearchOptions(features=SUPPORTED | feature))
            except Exception as e:  # noqa: BLE001 - a cell that cannot be planned is reported, not fatal
                print(f"  {gpus:>4} GPUs: {time.perf_counter() - started:.2f} s ({type(e).__name__})")
                continue
            seconds = time.perf_counter() - started
            verdict = "within" if seconds <= CP_EP_BOUND_S else "OVER"
            print(f"  {gpus:>4} GPUs: {seconds:.2f} s ({verdict}), {result.solver.candidates_evaluated} layouts, "
                  f"chose {layouts.describe(result.best.parallelism)}: "
                  f"{result.best.predicted.step_time_s:.2f} s/step")


SEQUENCE_FILE = '''import sys
sys.path.insert(0, {folder!r})
import {stem} as model_file
if hasattr(model_file, "llama"):
    model_file.llama.SEQ_LEN = {seq}
else:
    model_file.SEQ_LEN = {seq}
build_model, example_batch, loss_fn = model_file.build_model, model_file.example_batch, model_file.loss_fn
'''


def _timed_cli(command: list[str]) -> tuple[int, float, float, float, str]:
    """(exit code, wall s, CPU s of the run, peak RSS bytes, stderr's last line) of one CLI run in a fresh process,
    under /usr/bin/time -v when it exists (its "Maximum resident set size"), else getrusage's ru_maxrss of the
    children."""
    verbose = Path("/usr/bin/time").is_file()
    wrapped = ["/usr/bin/time", "-v", *command] if verbose else command
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    rss = after.ru_maxrss * 1024.0
    lines = proc.stderr.splitlines()
    for line in lines:
        if "Maximum resident set size" in line:
            rss = int(line.rsplit(":", 1)[1]) * 1024.0
    errors = [line for line in lines if not line.startswith(("\t", "Command "))]
    return proc.returncode, wall, cpu, rss, errors[-1] if errors else ""


def _chosen_and_experts(out: Path) -> tuple[str, int, int]:
    """(the chosen layout as candidates.csv's first row has it, ep > 1 rows that fit, ep > 1 rows)."""
    import csv

    with open(out / "candidates.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    first = rows[0]
    keys = ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp", "schedule", "microbatch", "recompute")
    chosen = " ".join(f"{k}={first[k]}" for k in keys) + \
        f": {float(first['step_time_s']):.2f} s/step, {float(first['peak_memory_gib']):.1f} GiB"
    expert = [r for r in rows if int(r["ep"]) > 1]
    return chosen, sum(r["fits"] == "True" for r in expert), len(expert)


def big_models() -> None:
    """Each big model planned from its config by `python -m autoplan` as a user runs it (issue 28)."""
    folder = ROOT / "benchmarks" / "models"
    print(f"\n## Big models through the CLI on H100s (bounds {BIG_BOUND_S:g} s, "
          f"{BIG_BOUND_RSS_BYTES / 2**30:g} GiB; load average {os.getloadavg()[0]:.1f})")
    for name, stem, seq, gpus, batch in BIG_MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{stem}_{seq}.py"
            path.write_text(SEQUENCE_FILE.format(folder=str(folder), stem=stem, seq=seq))
            out = Path(tmp) / "out"
            code, wall, cpu, rss, error = _timed_cli(
                [sys.executable, "-m", "autoplan", str(path), "--gpus", str(gpus), "--gpu", "h100-sxm5-80gb",
                 "--global-batch", str(batch), "--out", str(out), "--quiet"])
            verdict = "within" if wall <= BIG_BOUND_S and rss <= BIG_BOUND_RSS_BYTES else "OVER"
            print(f"{name} ({seq} tokens, {gpus} GPUs, {batch} sequences): {wall:.1f} s wall, {cpu:.1f} s CPU, "
                  f"{rss / 2**30:.2f} GiB peak RSS ({verdict} the bounds), exit {code}")
            if code != 0:
                print(f"  {error}")
                continue
            chosen, fitting, expert = _chosen_and_experts(out)
            experts = f"{fitting} of {expert} ep > 1 layouts fit" if expert else "no ep > 1 layout listed (a dense model has none)"
            print(f"  chose {chosen}\n  candidates.csv: {experts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12/48/128 layers and 8/512 GPUs only")
    parser.add_argument("--skip-capture", action="store_true", help="skip the real capture paths")
    parser.add_argument("--cli-only", action="store_true", help="only the whole CLI run for the 1T GPT")
    parser.add_argument("--cp-ep", action="store_true", help="only the context- and expert-parallel searches")
    parser.add_argument("--big", action="store_true", help="only the big models through the CLI (issue 28)")
    args = parser.parse_args()
    if args.big:
        big_models()
        return
    if args.cli_only:
        whole_cli()
        return
    if args.cp_ep:
        context_and_expert()
        return
    if args.quick:
        grid((12, 48, 128), (8, 512))
    else:
        grid(tuple(SHAPES), GPU_COUNTS)
    one_trillion()
    if not args.skip_capture:
        capture_path()
        context_and_expert()
        whole_cli()
        big_models()


if __name__ == "__main__":
    main()
