"""When no layout fits: how much memory per GPU the leanest layout needs, and a GPU count that fits."""

from __future__ import annotations

import dataclasses
import math

from autoplan.errors import Infeasible
from autoplan.solve import layouts
from autoplan.cost.context import GIB, Context, gib
from autoplan.cost.evaluate import Candidate, build_problem
from autoplan.solve.pins import Pins
from autoplan.solve.dp import leanest_assignment
from autoplan.solve.split import greedy_split

LARGER_GPU_COUNTS_TRIED = 6
"""How many larger power-of-two GPU counts an Infeasible message looks at."""


def infeasible_message(ctx: Context, pins: Pins, candidates: list[Candidate]) -> Infeasible:
    cluster, training = ctx.cluster, ctx.training
    cap = cluster.usable_memory_bytes
    leanest = _leanest(ctx, candidates)
    needed = leanest.memory_needed_bytes
    message = (f"no layout fits {cluster.num_gpus} GPUs with {gib(cap)} GiB usable each: the leanest "
               f"({layouts.describe(leanest.parallelism)}) needs {gib(needed)} GiB per GPU")
    count = _smallest_fitting_count(ctx, pins)
    largest = _larger_counts(cluster.num_gpus)[-1]
    if count is None:
        return Infeasible(message + (f"; no GPU count up to {largest} fits at global batch "
                                     f"{training.global_batch_size} "
                                     f"(try --memory-per-gpu {math.ceil(needed / GIB)}GiB)"))
    return Infeasible(message + f"; {count} GPUs would fit (try --gpus {count} or --memory-per-gpu "
                                f"{math.ceil(needed / GIB)}GiB)")


def _leanest(ctx: Context, candidates: list[Candidate]) -> Candidate:
    """The candidate needing the least memory per GPU, pruned ones solved for their leanest split."""
    exact = []
    for c in candidates:
        if c.stages:
            exact.append(c)
            continue
        par = c.parallelism
        problem = build_problem(ctx, par, layouts.modes_for(par.activation_checkpoint, False))
        found = leanest_assignment(problem)
        needed = max(problem.peak_memory(found)) if found else c.memory_needed_bytes
        exact.append(dataclasses.replace(c, memory_needed_bytes=needed))
    return min(exact, key=lambda c: c.memory_needed_bytes)


def _larger_counts(num_gpus: int) -> list[int]:
    first = 2 ** math.ceil(math.log2(num_gpus + 1))
    return [first * 2**k for k in range(LARGER_GPU_COUNTS_TRIED)]


def _smallest_fitting_count(ctx: Context, pins: Pins) -> int | None:
    """The smallest larger power-of-two GPU count (dp pin dropped) at which some layout fits, each family
    tried at its leanest variant (smallest micro-batch, most recompute)."""
    relaxed = dataclasses.replace(pins, dp=None)
    original = ctx.cluster
    try:
        for count in _larger_counts(original.num_gpus):
            ctx.cluster = dataclasses.replace(original, num_gpus=count)
            scope = layouts.scope_of(ctx)
            for fam in layouts.families(relaxed, scope):
                found = layouts.variants(fam, relaxed, scope)
                if not found:
                    continue
                lean = min(found, key=layouts.leanness)
                problem = build_problem(ctx, layouts.parallelism(fam, lean, lean.recompute), (lean.recompute,))
                if problem.memory_lower_bound() <= problem.memory_cap_bytes and greedy_split(problem, lean.recompute):
                    return count
        return None
    finally:
        ctx.cluster = original
