"""The report's scaling curve: the best predicted throughput at other GPU counts than the plan's (weak scaling,
the same batch per GPU), each count searched by the search's branch and bound within a shared time budget."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from autoplan.errors import UserError
from autoplan.hardware.types import Cluster
from autoplan.plan import Training
from autoplan.profile_data import ModelProfile
from autoplan.solve.refusals import pins_for_capture

log = logging.getLogger("autoplan")

SCALING_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1, 2, 4)
"""GPU counts of the report's scaling curve, as multiples of the planned count."""
SCALING_BUDGET_S = 4.0
"""Seconds the scaling curve may spend pricing layouts, all its GPU counts together (the planned count is not
searched again). Each count gets an equal share of what is left, so a count that finishes early leaves more
to the next; a count whose share runs out shows the best of the layouts priced by then, and the report says so."""


class ScalingPoint(NamedTuple):
    """One GPU count of the scaling curve (weak scaling: the same batch per GPU as the plan)."""

    gpus: int
    samples_per_s: float | None
    """Predicted throughput of the best layout found; None when none fits (or none priced within the budget did)."""
    layout: str = ""
    """layouts.describe() of that layout."""
    note: str = ""
    """"" for a search that ran to the end; else how the point is bounded, or why there is none."""


def scaling_curve(profile: ModelProfile, cluster: Cluster, training: Training, planned: Any = None,
                  budget_s: float = SCALING_BUDGET_S, context: Any = None) -> tuple[ScalingPoint, ...]:
    """The best predicted throughput at N/8 .. 4N GPUs, the same batch per GPU, pricing layouts for at most
    `budget_s` seconds in all. `planned` (a Candidate) is the unpinned search's winner at N GPUs: its point
    is taken as is instead of searching again. `context` (the search's cost.context.Context) lends its
    priced modules to the counts with the same GPUs per node.

    Each count runs the search's branch and bound (autoplan.solve.search.explore) on one shared Context per
    node size: the chain, the tensor-parallel facts, the module tables and the memory inputs do not depend on
    the GPU count or the batch. Unlike the full search it skips the MILP refinement of the winner's split
    (only samples/s is drawn) and does not work out why nothing fits (the leanest split and a GPU count
    that would fit)."""
    from dataclasses import replace

    from autoplan.cost.context import Context
    from autoplan.layout import SUPPORTED as features
    from autoplan.layout import Layout
    from autoplan.solve import layouts

    pins = pins_for_capture(Layout(), profile, warn=False)
    # by GPUs per node: the module tables' tensor-parallel links depend on it
    contexts: dict[int, Context] = {cluster.gpus_per_node: context} if context is not None else {}
    counts = sorted({max(1, round(cluster.num_gpus * f)) for f in SCALING_FACTORS})
    log.info("scaling curve: best layouts at %s GPUs (%s to %s times the plan's %d)", ", ".join(map(str, counts)),
             _fraction(min(SCALING_FACTORS)), _fraction(max(SCALING_FACTORS)), cluster.num_gpus)
    compiled = context.compiled if context is not None else layouts.compiled(pins, cluster, features)
    searched = [c for c in counts if c != cluster.num_gpus or planned is None]
    deadline = time.perf_counter() + budget_s
    points = []
    for count in counts:
        if count not in searched:
            points.append(ScalingPoint(count, planned.predicted.samples_per_s, layouts.describe(planned.parallelism)))
            continue
        per_node = min(cluster.gpus_per_node, count)
        if per_node not in contexts:
            contexts[per_node] = Context(profile, replace(cluster, gpus_per_node=per_node), training, features,
                                         compiled=compiled)
        batch = max(1, training.global_batch_size * count // cluster.num_gpus)
        ctx = contexts[per_node].at(replace(cluster, num_gpus=count, gpus_per_node=per_node),
                                    replace(training, global_batch_size=batch))
        started = time.perf_counter()
        share = max(0.0, deadline - started) / (len(searched) - searched.index(count))
        point = _scaling_point(ctx, pins, share)
        log.debug("scaling curve: %d GPUs in %.2f s (share %.2f s): %s", count, time.perf_counter() - started,
                  share, point)
        points.append(point)
    return tuple(points)


def _fraction(factor: float) -> str:
    """1/8 for 0.125, 4 for 4.0."""
    return f"{factor:g}" if factor >= 1 else f"1/{round(1 / factor)}"


def _scaling_point(ctx, pins, budget_s: float) -> ScalingPoint:
    """The search's branch and bound at ctx's GPU count (autoplan.solve.search.explore), without the MILP
    refinement and the infeasibility explanation, stopped after `budget_s` seconds."""
    from autoplan.solve import layouts
    from autoplan.solve.search import choose, explore

    count = ctx.cluster.num_gpus
    try:
        explored = explore(ctx, pins, deadline=time.perf_counter() + budget_s, explain=False)
    except UserError as e:
        return ScalingPoint(count, None, "", str(e))
    fitting = sorted((c for c in explored.tried if c.fits), key=lambda c: c.predicted.step_time_s)
    # explore checks its bound before the deadline: when the deadline stopped it, the next layout could still win
    budget = f"the {budget_s:.2g} s this count had of the curve's time budget"
    if not fitting:
        why = (f"none of the {explored.priced} layouts priced in {budget} fits; the search did not finish"
               if explored.stopped_by_deadline else "no layout fits")
        return ScalingPoint(count, None, "", why)
    best = choose(fitting)
    note = (f"bounded: best of the {explored.priced} layouts priced in {budget}; unpriced ones could be faster"
            if explored.stopped_by_deadline else "")
    return ScalingPoint(count, best.predicted.samples_per_s, layouts.describe(best.parallelism), note)
