"""Plan every example model, and a few published Hugging Face configs, for several GPU counts; print a
table of outcomes. None may crash (exit 1) or hang: a run that does either fails the sweep.

    python benchmarks/model_zoo_sweep.py                  every example at 1, 8 and 64 H100s
    python benchmarks/model_zoo_sweep.py --gpus 8,512 --timeout 300

Exit code 2 from autoplan is an answer (bad input or "no layout fits", with its one line), not a failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Published configs, built by patching an example's module constants before it builds the model.
HF_CONFIGS = {
    "llama-3-70b": ("llama", {"LAYERS": 80, "HIDDEN": 8192, "INTERMEDIATE": 28672, "HEADS": 64, "KV_HEADS": 8}),
    "gpt2-xl": ("hf_gpt2", None),
}


def wrapper(example: str, constants: dict | None) -> str:
    lines = [f"import sys; sys.path.insert(0, {str(EXAMPLES)!r})", f"import {example} as base"]
    lines += [f"base.{name} = {value!r}" for name, value in (constants or {}).items()]
    lines.append("build_model, example_batch = base.build_model, base.example_batch")
    lines.append("loss_fn = getattr(base, 'loss_fn', None)")
    return "\n".join(lines) + "\n"


def run(model: Path, gpus: int, timeout_s: float, out: Path) -> tuple[str, float, str]:
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "autoplan", str(model), "--gpus", str(gpus), "--quiet",
                               "--out", str(out)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "HANG", time.perf_counter() - start, f"no answer in {timeout_s:g} s"
    seconds = time.perf_counter() - start
    last = (done.stderr.strip().splitlines() or [""])[-1][:110]
    outcome = {0: "planned", 2: "answered"}.get(done.returncode, f"CRASH({done.returncode})")
    return outcome, seconds, last if done.returncode else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,8,64")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args()
    counts = [int(n) for n in args.gpus.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        models = {path.stem: path for path in sorted(EXAMPLES.glob("*.py"))}
        for name, (example, constants) in HF_CONFIGS.items():
            models[name] = Path(tmp, f"{name.replace('-', '_')}.py")
            models[name].write_text(wrapper(example, constants))
        failures = 0
        print(f"{'model':<14} {'gpus':>5}  {'outcome':<10} {'seconds':>8}  message")
        for name, path in models.items():
            for gpus in counts:
                outcome, seconds, message = run(path, gpus, args.timeout, Path(tmp, "out"))
                failures += outcome.startswith(("CRASH", "HANG"))
                print(f"{name:<14} {gpus:>5}  {outcome:<10} {seconds:8.1f}  {message}", flush=True)
    print(f"{len(models) * len(counts) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
