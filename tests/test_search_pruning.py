"""The search's shortcuts for big models change no result: each one is checked against the slow path it replaces.

- cost/evaluate.py memory_lower_bound (remembered per the layout's shared memory vectors, its fewest in-flight
  micro-batches, ranks and modes) is build_problem(...).memory_lower_bound() exactly, for every variant a search
  enumerates (single-stage and pipelined, every ZeRO stage, CPU offload, every schedule and recompute mode);
- the bound never prunes a layout that fits: it stays under the memory of every split the packing finds.
"""

from dataclasses import replace

from chain_fixtures import cluster, gpt_profile

from autoplan.cost.context import Context, Pricing
from autoplan.cost.evaluate import build_problem, memory_lower_bound
from autoplan.layout import ALL_FEATURES, SUPPORTED, Layout
from autoplan.plan import Training
from autoplan.solve import layouts
from autoplan.solve.search import runnable, search
from autoplan.solve.split import greedy_split


def _variants(ctx: Context, pins: Layout = Layout()):
    """(family, variant, recompute modes) of every layout the search of `ctx` enumerates."""
    scope = layouts.scope_of(ctx)
    for fam in layouts.families(pins, scope):
        for var in layouts.variants(fam, pins, scope):
            par = layouts.parallelism(fam, var, var.recompute)
            yield runnable(ctx, par, pins, scope), par, layouts.modes_for(var.recompute, False)


def test_the_remembered_memory_bound_is_the_problems_own_for_every_variant():
    profile = gpt_profile(n_layer=6, n_embd=256, vocab=1024, seq=128, batch=2, n_head=8)
    checked = pipelined = 0
    for features in (SUPPORTED, ALL_FEATURES):
        ctx = Context(profile, cluster(16), Training(global_batch_size=32, dtype="bf16"), features, Pricing(compiled=True))
        for run, par, modes in _variants(ctx):
            assert memory_lower_bound(run, par, modes) == build_problem(run, par, modes).memory_lower_bound(), \
                par.text()
            checked += 1
            pipelined += par.pp > 1
    assert checked > 1000 and pipelined > 500  # every schedule's in-flight counts, not a handful of layouts


def test_the_bound_never_prunes_a_split_that_fits():
    """A cap just under a layout's packed split: the bound must stay at or under every split the packing finds,
    whatever the cap, so that the search prunes by it only layouts no split of which fits."""
    profile = gpt_profile(n_layer=8, n_embd=512, vocab=2048, seq=256, batch=2, n_head=8)
    ctx = Context(profile, cluster(8), Training(global_batch_size=16, dtype="bf16"), SUPPORTED, Pricing(compiled=True))
    seen = 0
    for run, par, modes in _variants(ctx):
        problem = build_problem(run, par, modes)
        found = greedy_split(problem, modes[0] if len(modes) == 1 else None)
        if found is None:
            continue
        peak = max(problem.peak_memory(found))
        assert memory_lower_bound(run, par, modes) <= peak * (1 + 1e-12), par.text()
        seen += 1
    assert seen > 100


def test_a_cap_at_the_bound_keeps_the_layout_searchable():
    """The pruning compares the bound with the cap strictly: a cap equal to the winner's bound never refuses it."""
    profile = gpt_profile(n_layer=4, n_embd=512, vocab=2048, seq=256, batch=2, n_head=8)
    training = Training(global_batch_size=8, dtype="bf16")
    pins = Layout(dp=8, dp_replicate=1, dp_shard=8, reshard="always", pp=1, microbatch=1, recompute="full")
    first = search(profile, cluster(8), training, pins)
    bound = memory_lower_bound(first.context, first.best.parallelism, ("full",))
    assert bound <= first.best.predicted.peak_memory_bytes
    at_bound = search(profile, replace(cluster(8), memory_per_gpu_bytes=first.best.predicted.peak_memory_bytes),
                      training, pins)
    assert at_bound.best.fits



def test_the_remembered_time_bound_is_time_lower_bound_for_every_variant():
    """search._time_bounds remembers the module tables' slot per micro-batch size (and recompute mode when pinned):
    every variant's bound is time_lower_bound's own, computed afresh; and variants of one family that differ in their
    micro-batch size (or, pinned, only in their recompute) have different slots, so the memo must not share them."""
    from autoplan.solve.search import _slot, _time_bounds, time_lower_bound

    profile = gpt_profile(n_layer=6, n_embd=256, vocab=1024, seq=128, batch=2, n_head=8)
    for pinned in (False, True):
        ctx = Context(profile, cluster(16), Training(global_batch_size=32, dtype="bf16"), ALL_FEATURES,
                      Pricing(compiled=True))
        bound = _time_bounds(ctx, pinned)
        scope = layouts.scope_of(ctx)
        by_size = by_mode = 0
        for fam in layouts.families(Layout(), scope):
            found = layouts.variants(fam, Layout(), scope)
            for var in found:
                assert bound(fam, var) == time_lower_bound(ctx, fam, var, pinned), (fam.text(), var)
            by_size += len({_slot(ctx, fam, var, pinned) for var in found if var.recompute == "none"}) > 1
            same_size = [var for var in found if var.microbatch == found[0].microbatch]
            by_mode += len({_slot(ctx, fam, var, pinned) for var in same_size}) > 1
        assert by_size
        assert bool(by_mode) == pinned  # unpinned, the bound prices every mode at recompute=none
