"""Plan and verify every model family in benchmarks/zoo/ (tiny transformers configs, no download). The
zoo's files group families by task (causal_lm, masked_lm, classification, seq2seq, vision); each names
its factories in FAMILIES, planned as FILE.py:FAMILY.

For each model it plans three layouts and checks the two that run here:

    dp2       autoplan MODEL --gpus 2 --gpu cpu --pin dp=2 --global-batch 4             then autoplan verify
    pp2       autoplan MODEL --gpus 2 --gpu cpu --pin pp=2,microbatch=1 --global-batch 4 (4 micro-batches),
              then autoplan verify
    h100x64   autoplan MODEL --gpus 64                                                  (planning only)

and records, per model and layout: planned / refused (exit 2, its one line) / CRASH (another exit code,
the first error line) / HANG (the timeout), the layout chosen, the planning time, and for the CPU plans
verify's verdict (PASS/FAIL with max |diff| from verify.json, or CRASH/HANG with the first error line)
and its time. It prints a table and writes it to a CSV. Every run is bounded by --timeout.

    nice -n 10 python benchmarks/model_zoo.py                          # every family, results in model_zoo.csv
    nice -n 10 python benchmarks/model_zoo.py --models qwen2,bart --layouts dp2,pp2 --timeout 180
    nice -n 10 python benchmarks/model_zoo.py --work /tmp/zoo_runs    # keep every plan folder to re-verify

A plan that is written and then fails verify (CRASH, FAIL or HANG) is a bug in autoplan (issue 17); a
refusal at planning time is an answer, not a crash. The exit code is 1 when any run crashed, hung or
failed parity, else 0.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = Path(__file__).resolve().parent / "zoo"


def zoo_families() -> dict[str, Path]:
    """Family name -> the zoo file whose factory it is (each file's FAMILIES)."""
    found = {}
    for path in sorted(ZOO.glob("*.py")):
        for name in ast.literal_eval(next(node.value for node in ast.parse(path.read_text()).body
                                          if isinstance(node, ast.Assign) and node.targets[0].id == "FAMILIES")):
            found[name] = path
    return found

LAYOUTS = {
    "dp2": (["--gpus", "2", "--gpu", "cpu", "--pin", "dp=2", "--global-batch", "4"], True),
    "pp2": (["--gpus", "2", "--gpu", "cpu", "--pin", "pp=2,microbatch=1", "--global-batch", "4"], True),
    "h100x64": (["--gpus", "64"], False),
}
"""name: (autoplan arguments after MODEL, whether to run autoplan verify on the plan)."""

ERROR_LINE = re.compile(r"^(\S*(Error|Exception|error|Failure)\b|autoplan[^:]*: )")


@dataclass
class Row:
    model: str
    layout: str
    plan: str = ""  # planned, refused, CRASH(rc), HANG
    layout_chosen: str = ""
    plan_s: float = 0.0
    verify: str = "-"  # PASS, FAIL, CRASH(rc), HANG, -
    max_diff: str = ""
    verify_s: float = 0.0
    message: str = ""  # the refusal, or the first error line


def first_error_line(text: str) -> str:
    """verify's `first exception: ...` line, else the first line that names an error (an exception's
    `Type: message` or autoplan's own one line), else the last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:  # verify names the distributed run's first exception on a line of its own
        if line.startswith("first exception:"):
            return line[:240]
    for line in lines:
        if ERROR_LINE.match(line) and not line.startswith(("autoplan: planned", "autoplan: writing")):
            return line[:240]
    return lines[-1][:240] if lines else ""


def describe(parallelism: dict) -> str:
    p = parallelism
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    text = f"dp={dp} shard={p['data_parallel_shard_degree']} tp={p['tensor_parallel_degree']} " \
           f"pp={p['pipeline_parallel_degree']}"
    if p["pipeline_parallel_degree"] > 1 or p["pipeline_parallel_num_microbatches"] > 1:
        text += f" {p['pipeline_parallel_schedule']} mb={p['pipeline_parallel_microbatch_size']}" \
                f"x{p['pipeline_parallel_num_microbatches']}"
    if p.get("activation_checkpoint", "none") != "none":
        text += f" recompute={p['activation_checkpoint']}"
    return text


def run(command: list[str], timeout_s: float) -> tuple[int | None, float, str, str]:
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start, "", ""
    return done.returncode, time.perf_counter() - start, done.stdout, done.stderr


def plan_and_verify(name: str, model: Path, layout: str, out: Path, timeout_s: float) -> Row:
    arguments, verify = LAYOUTS[layout]
    row = Row(name, layout)
    rc, row.plan_s, _, stderr = run([sys.executable, "-m", "autoplan", f"{model}:{name}", *arguments, "--quiet",
                                     "--out", str(out)], timeout_s)
    if rc is None:
        row.plan, row.message = "HANG", f"no plan in {timeout_s:g} s"
        return row
    if rc != 0:
        row.plan = "refused" if rc == 2 else f"CRASH({rc})"
        row.message = first_error_line(stderr)
        return row
    row.plan = "planned"
    row.layout_chosen = describe(json.loads((out / "plan.json").read_text())["parallelism"])
    if not verify:
        return row
    rc, row.verify_s, stdout, stderr = run([sys.executable, "-m", "autoplan", "verify", str(out),
                                            "--timeout", str(timeout_s)], timeout_s + 30)
    result = out / "verify.json"
    if result.exists() and rc in (0, 1, 2):
        verdict = json.loads(result.read_text())
        diff = verdict.get("parity_max_abs_diff")
        row.max_diff = "nan" if diff is None else f"{diff:.3g}"
        row.verify = "PASS" if verdict.get("passed") else "FAIL"
        if not verdict.get("passed"):
            row.message = first_error_line(stderr) or first_error_line(stdout)
    elif rc is None:
        row.verify, row.message = "HANG", f"no verdict in {timeout_s + 30:g} s"
    else:
        row.verify = f"CRASH({rc})"
        row.message = first_error_line(stderr) or first_error_line(stdout)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated names from benchmarks/zoo (default all)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per autoplan run (plan or verify)")
    parser.add_argument("--csv", default="model_zoo.csv", help="where the table is written")
    parser.add_argument("--work", default="", help="keep the plan folders here (default: a temporary folder)")
    args = parser.parse_args()
    families = zoo_families()
    names = [n for n in args.models.split(",") if n] or sorted(families)
    layouts = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in layouts if n not in LAYOUTS] + [n for n in names if n not in families]
    if unknown:
        parser.error(f"unknown layout or model: {', '.join(unknown)}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="autoplan_zoo_"))
    rows: list[Row] = []
    started = time.perf_counter()
    header = f"{'model':<12} {'layout':<8} {'plan':<9} {'plan s':>6} {'chosen':<32} {'verify':<9} {'max|diff|':>9} " \
             f"{'verify s':>8}  message"
    print(header, flush=True)
    with open(args.csv, "w", newline="") as stream:
        writer = csv.DictWriter(stream, [f.name for f in fields(Row)])
        writer.writeheader()
        for name in names:
            for layout in layouts:
                row = plan_and_verify(name, families[name], layout, work / f"{name}_{layout}", args.timeout)
                rows.append(row)
                writer.writerow({k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(row).items()})
                stream.flush()
                print(f"{row.model:<12} {row.layout:<8} {row.plan:<9} {row.plan_s:6.1f} {row.layout_chosen:<32} "
                      f"{row.verify:<9} {row.max_diff:>9} {row.verify_s:8.1f}  {row.message}", flush=True)
    bad = [r for r in rows if r.plan.startswith(("CRASH", "HANG")) or r.verify not in ("PASS", "-")]
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s: "
          f"{sum(r.verify == 'PASS' for r in rows)} verified PASS, {sum(r.plan == 'refused' for r in rows)} refused, "
          f"{len(bad)} crashed, hung or failed parity; table in {args.csv}, plan folders in {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
