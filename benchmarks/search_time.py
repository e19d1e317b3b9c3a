"""How long the searches the tests check take, against the bounds the tests used to assert.

    python benchmarks/search_time.py [--repeats N] [--repeats-1t N] [--skip-1t]

The tests check what these searches find (tests/test_search.py::test_search_is_deterministic,
tests/test_search_scale.py); wall-clock bounds depend on the machine and on what else runs on it, so
the timing lives here and is printed, not asserted:

- a 12-layer GPT on 8 GPUs, global batch 32: one search pinned to pp=4 and one unpinned (bound 3 s);
- a 1T GPT (128 layers, h 25600, 160 heads) on 3072 A100s, the full search with every feature the
  cost model knows (bound 60 s), and the published tp=8, pp=64 layout priced by the same model.

Each 12-layer figure is the median of --repeats runs (default 3); the 1T search runs --repeats-1t times
(default 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the GPT profile generator and cluster fixtures live with the tests

from chain_fixtures import cluster, gpt_profile, read_runs, run_cluster, run_pins, run_profile  # noqa: E402

from autoplan.layout import ALL_FEATURES, Layout  # noqa: E402
from autoplan.plan import Training  # noqa: E402
from autoplan.solve import layouts  # noqa: E402
from autoplan.solve.pins import parse_pins  # noqa: E402
from autoplan.solve.search import SearchOptions, search  # noqa: E402

SMALL_BOUND_S = 3.0
"""Both 12-layer searches together, seconds (was asserted by tests/test_search.py)."""
ONE_T_BOUND_S = 60.0
"""The 1T GPT's full search on 3072 A100s, seconds (was asserted by tests/test_search_scale.py)."""


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), seconds, result


def verdict(seconds: float, bound: float) -> str:
    return f"{'within' if seconds <= bound else 'OVER'} the {bound:g} s bound"


def small(repeats: int) -> None:
    profile = gpt_profile(n_layer=12)
    training = Training(global_batch_size=32)
    pinned_s, _, pinned = timed(lambda: search(profile, cluster(8), training, Layout(pp=4)), repeats)
    free_s, _, free = timed(lambda: search(profile, cluster(8), training), repeats)
    total = pinned_s + free_s
    print(f"## 12-layer GPT on 8 GPUs, global batch 32 (median of {repeats})")
    print(f"pinned pp=4: {pinned_s:.3f} s, {pinned.solver.candidates_evaluated} layouts, "
          f"chose {layouts.describe(pinned.best.parallelism)}")
    print(f"unpinned:    {free_s:.3f} s, {free.solver.candidates_evaluated} layouts, "
          f"chose {layouts.describe(free.best.parallelism)}")
    print(f"both: {total:.3f} s ({verdict(total, SMALL_BOUND_S)})")


def one_trillion(repeats: int) -> None:
    row = next(r for r in read_runs(ROOT / "tests" / "fixtures" / "published_runs.csv") if r["pp"] == "64")
    profile, cluster_1t = run_profile(row), run_cluster(row)
    training = Training(global_batch_size=int(row["global_batch_seqs"]), dtype="bf16")
    full_s, runs, result = timed(lambda: search(profile, cluster_1t, training,
                                                options=SearchOptions(features=ALL_FEATURES)), repeats)
    pinned_s, _, published = timed(
        lambda: search(profile, cluster_1t, training, parse_pins(run_pins(row)),
                       options=SearchOptions(features=ALL_FEATURES)), 1)
    best, theirs = result.best.predicted.step_time_s, published.best.predicted.step_time_s
    print(f"\n## 1T GPT (128 x 25600, 160 heads) on {row['gpus']} A100s (median of {repeats})")
    print(f"full search: {full_s:.1f} s ({verdict(full_s, ONE_T_BOUND_S)}; runs "
          f"{', '.join(f'{s:.1f}' for s in runs)}), {result.solver.candidates_evaluated} layouts, "
          f"MILP {result.solver.status}")
    print(f"published layout priced: {pinned_s:.1f} s")
    print(f"chosen    {layouts.describe(result.best.parallelism)}: {best:.1f} s/step")
    print(f"published {layouts.describe(published.best.parallelism)}: {theirs:.1f} s/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median printed)")
    parser.add_argument("--skip-1t", action="store_true", help="only the 12-layer searches")
    parser.add_argument("--repeats-1t", type=int, default=1, help="runs of the 1T search")
    args = parser.parse_args()
    small(max(1, args.repeats))
    if not args.skip_1t:
        one_trillion(max(1, args.repeats_1t))


if __name__ == "__main__":
    main()
