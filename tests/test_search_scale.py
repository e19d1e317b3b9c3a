"""The full search at scale: a 1T GPT (128 layers, h 25600, 160 heads, seq 2048, vocab 51200) on 3072
A100s, and its plan predicted at least as fast as the published tp=8, pp=64 layout (both priced with
every feature the cost model knows, vocabulary-parallel head included, as Megatron-LM ran it).
How long the search takes (bound: 60 s): benchmarks/search_time.py."""

import re
from pathlib import Path

from chain_fixtures import read_runs, run_cluster, run_pins, run_profile

from autoplan.errors import UserError
from autoplan.hardware.types import Cluster
from autoplan.layout import ALL_FEATURES
from autoplan.plan import Training
from autoplan.solve.pins import parse_pins
from autoplan.solve.search import SearchOptions, search

ONE_T = next(r for r in read_runs(Path(__file__).parent / "fixtures" / "published_runs.csv") if r["pp"] == "64")


def test_1t_gpt_on_3072_gpus_is_planned_and_beats_or_ties_the_published_layout():
    profile, cluster = run_profile(ONE_T), run_cluster(ONE_T)
    training = Training(global_batch_size=int(ONE_T["global_batch_seqs"]), dtype="bf16")
    result = search(profile, cluster, training, options=SearchOptions(features=ALL_FEATURES))
    published = search(profile, cluster, training, parse_pins(run_pins(ONE_T)),
                       options=SearchOptions(features=ALL_FEATURES)).best
    assert result.best.fits and result.best.predicted.peak_memory_bytes <= cluster.usable_memory_bytes
    assert result.best.predicted.step_time_s <= published.predicted.step_time_s * (1 + 1e-9)
    assert result.solver.candidates_evaluated > 10_000 and result.solver.status in ("optimal", "time_limit")


def test_the_1t_gpt_pinned_on_512_gpus_plans_or_says_a_leanest_need_above_the_usable_memory():
    """Issue 17's case: tp=8, pp=64, micro-batch 1, interleaved, full recompute on 512 A100 80GB, global
    batch 512, with the features the program runs. A refusal once named a "leanest" layout that fit."""
    profile = run_profile(ONE_T)
    cluster = Cluster(run_cluster(ONE_T).hardware, 512, int(ONE_T["gpus_per_node"]))
    pins = parse_pins("tp=8,pp=64,microbatch=1,schedule=interleaved,recompute=full")
    try:
        best = search(profile, cluster, Training(global_batch_size=512, dtype="bf16"), pins).best
    except UserError as refusal:
        found = re.search(r"with ([\d.]+) GiB usable each: the leanest \(.*\) needs ([\d.]+) GiB per GPU", str(refusal))
        assert found, str(refusal)
        usable, needed = map(float, found.groups())
        assert needed > usable and usable == round(cluster.usable_memory_bytes / 2**30, 1)
    else:
        assert best.fits and best.predicted.peak_memory_bytes <= cluster.usable_memory_bytes
        assert (best.parallelism.tp, best.parallelism.pp) == (8, 64)
