"""When no layout fits: how much memory per GPU the leanest layout needs, and a GPU count that fits."""

from __future__ import annotations

import dataclasses
import math

from autoplan.cost.context import GIB, Context, gib
from autoplan.cost.evaluate import Candidate, build_problem, host_oom_reason, offload_host_bytes
from autoplan.errors import Infeasible
from autoplan.layout import Layout
from autoplan.solve import layouts
from autoplan.solve.dp import leanest_assignment
from autoplan.solve.split import greedy_split

LARGER_GPU_COUNTS_TRIED = 6
"""How many larger power-of-two GPU counts an Infeasible message looks at."""


def infeasible_message(ctx: Context, pins: Layout, candidates: list[Candidate]) -> Infeasible:
    cluster, training = ctx.cluster, ctx.training
    cap = cluster.usable_memory_bytes
    host = [c for c in candidates if host_oom_reason(ctx, c.parallelism)]
    leanest = _leanest(ctx, [c for c in candidates if c not in host])
    needed = leanest.memory_needed_bytes
    assert needed > cap, f"the leanest layout needs {needed} bytes, within the {cap} usable: it fits"
    message = (f"no layout fits {cluster.num_gpus} GPUs with {gib(cap)} GiB usable each: the leanest "
               f"({layouts.describe(leanest.parallelism)}) needs {gib(needed)} GiB per GPU")
    if host:  # CPU offload would take the model states off the GPUs, but the host cannot hold them
        need = min(offload_host_bytes(ctx, c.parallelism) for c in host)
        message += (f"; CPU offload needs {gib(need)} GiB of host memory per node, has "
                    f"{gib(cluster.host_memory_bytes)} GiB (--host-memory-per-node)")
    count = _smallest_fitting_count(ctx, pins)
    largest = _larger_counts(cluster.num_gpus)[-1]
    if count is None:
        return Infeasible(message + (f"; no GPU count up to {largest} fits at global batch "
                                     f"{training.global_batch_size} "
                                     f"(try --memory-per-gpu {math.ceil(needed / GIB)}GiB)"))
    return Infeasible(message + f"; {count} GPUs would fit (try --gpus {count} or --memory-per-gpu "
                                f"{math.ceil(needed / GIB)}GiB)")


def _leanest(ctx: Context, candidates: list[Candidate]) -> Candidate:
    """The candidate needing the least memory per GPU, pruned ones solved for their leanest split (on a
    tie, the first in `candidates`). A pruned candidate's memory_needed_bytes is a lower bound of its
    leanest split's, so they are solved in the order of that bound until it reaches the best found."""
    exact = [(c.memory_needed_bytes, i, c) for i, c in enumerate(candidates) if c.stages]
    pruned = sorted(((c.memory_needed_bytes, i, c) for i, c in enumerate(candidates) if not c.stages),
                    key=lambda entry: entry[:2])
    best = min(exact, key=lambda entry: entry[:2], default=None)
    for bound, i, c in pruned:
        if best is not None and bound > best[0]:
            break  # no split of this one or of any after it needs less than the best
        par = c.parallelism
        problem = build_problem(ctx, par, layouts.modes_for(par.recompute, False))
        found = leanest_assignment(problem)
        needed = max(problem.peak_memory(found)) if found else bound
        entry = (needed, i, dataclasses.replace(c, memory_needed_bytes=needed))
        if best is None or entry[:2] < best[:2]:
            best = entry
    return best[2]


def _larger_counts(num_gpus: int) -> list[int]:
    first = 2 ** math.ceil(math.log2(num_gpus + 1))
    return [first * 2**k for k in range(LARGER_GPU_COUNTS_TRIED)]


def _smallest_fitting_count(ctx: Context, pins: Layout) -> int | None:
    """The smallest larger power-of-two GPU count (dp pin dropped) at which some layout fits, each family
    tried at its leanest variant (smallest micro-batch, most recompute)."""
    relaxed = dataclasses.replace(pins, dp=None)
    for count in _larger_counts(ctx.cluster.num_gpus):
        larger = ctx.at(dataclasses.replace(ctx.cluster, num_gpus=count), ctx.training)
        scope = layouts.scope_of(larger)
        for fam in layouts.families(relaxed, scope):
            found = layouts.variants(fam, relaxed, scope)
            if not found:
                continue
            lean = min(found, key=layouts.leanness)
            par = layouts.parallelism(fam, lean, lean.recompute)
            if host_oom_reason(larger, par):
                continue
            problem = build_problem(larger, par, (lean.recompute,))
            if problem.memory_lower_bound() <= problem.memory_cap_bytes and greedy_split(problem, lean.recompute):
                return count
    return None
