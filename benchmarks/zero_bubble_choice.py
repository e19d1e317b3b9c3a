"""What the zero-bubble schedules buy the planner on two large models (issue 31).

    python benchmarks/zero_bubble_choice.py

Each model is searched twice with every feature the program runs (layout.SUPPORTED): once with the zero-bubble
schedules (zb-interleaved, zbv, dualpipev) removed, once with them; it prints both chosen layouts, their predicted
step times and pipeline bubbles and the step time the schedules gain; then the same with the pipeline depth pinned
to a few values (the free search may choose no pipeline at all, where the schedules cannot help).
- the 1T GPT (128 layers, hidden 25600, 160 heads, 2048 tokens; Narayanan et al. SC21's largest run) on 3072 A100
  80GB, global batch 3072 sequences, from the GPT profile generator (the numbers capture gives, tests/chain_fixtures.py)
  with SDPA attention as examples/gpt.py runs it (Megatron-LM 2021's explicit score matmuls split by heads only under
  the priced-only tp_fused_split feature);
- Llama-3.1-405B (benchmarks/models/llama31_405b.py, captured on fake tensors) at 8192 tokens on 1024 H100 80GB,
  global batch 2048 sequences (torchtitan's 405B runs use 2M-16M tokens per step).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the GPT profile generator lives with the tests
sys.path.insert(0, str(ROOT / "benchmarks" / "models"))

from chain_fixtures import a100_cluster, gpt_profile  # noqa: E402

from autoplan.capture import capture_model  # noqa: E402
from autoplan.errors import UserError  # noqa: E402
from autoplan.hardware.profiles import load_hardware  # noqa: E402
from autoplan.hardware.types import Cluster  # noqa: E402
from autoplan.layout import SUPPORTED, ZERO_BUBBLE_SCHEDULES  # noqa: E402
from autoplan.plan import Training  # noqa: E402
from autoplan.profile import profile_graph  # noqa: E402
from autoplan.solve import layouts  # noqa: E402
from autoplan.solve.pins import parse_pins  # noqa: E402
from autoplan.solve.search import SearchOptions, search  # noqa: E402
from autoplan.contract import load_source  # noqa: E402


def gpt_1t():
    profile = gpt_profile(n_layer=128, n_embd=25600, vocab=51200, seq=2048, batch=2, n_head=160,
                          device="a100-sxm4-80gb", attention="sdpa")
    return profile, a100_cluster(3072), Training(global_batch_size=3072, dtype="bf16")


def llama_405b():
    h100 = load_hardware("h100-sxm5-80gb")
    source = load_source(str(ROOT / "benchmarks" / "models" / "llama31_405b.py"))
    profile = profile_graph(capture_model(source, 1), source.spec, 1, h100, measure=False, dtype="bf16")
    return profile, Cluster(h100, 1024, 8), Training(global_batch_size=2048, dtype="bf16", tokens_per_sample=8192)


def row(label: str, result) -> float:
    best = result.best
    step = best.predicted.step_time_s
    bubble = best.predicted.time_breakdown.get("bubble", 0.0)
    print(f"  {label:<24} {layouts.describe(best.parallelism)}")
    print(f"  {'':<24} step {step:.3f} s, bubble {bubble:.3f} s, peak {best.predicted.peak_memory_bytes / 2**30:.1f} "
          f"GiB; searched in {result.solver.time_s:.1f} s")
    return step


def compare(profile, cluster, training, pins: str) -> None:
    """The best layout the pins allow without the zero-bubble schedules and with them."""
    without = SUPPORTED - set(ZERO_BUBBLE_SCHEDULES)
    try:
        base = row(f"{pins or 'free'}, without", search(profile, cluster, training, parse_pins(pins),
                                                        options=SearchOptions(features=without)))
        best = row(f"{pins or 'free'}, with", search(profile, cluster, training, parse_pins(pins),
                                                     options=SearchOptions(features=SUPPORTED)))
    except UserError as refusal:
        print(f"  {pins}: {str(refusal).splitlines()[0][:300]}")
        return
    print(f"  {'':<24} zero-bubble schedules gain {100 * (base - best) / base:+.1f}% step time")


def main() -> None:
    for name, build, depths in (("1T GPT on 3072 A100s", gpt_1t, (16, 32, 64)),
                                ("Llama-3.1-405B at 8K on 1024 H100s", llama_405b, (8, 16, 32))):
        started = time.perf_counter()
        profile, cluster, training = build()
        print(f"## {name} (profile in {time.perf_counter() - started:.1f} s)")
        for pins in ("", *(f"pp={pp}" for pp in depths)):
            compare(profile, cluster, training, pins)
        print()


if __name__ == "__main__":
    main()
