"""The report's scaling curve: the best predicted throughput at other GPU counts than the plan's (weak scaling,
the same batch per GPU), each count searched by the search's branch and bound up to SCALING_LAYOUTS priced layouts.
The CLI runs these searches in a forked process while it searches the planned count (ScalingInBackground): on a
machine with a second core the curve then costs no wall time of its own."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from typing import Any, NamedTuple

from autoplan.errors import UserError
from autoplan.hardware.types import Cluster
from autoplan.plan import Training
from autoplan.profile_data import ModelProfile
from autoplan.solve.refusals import pins_for_capture

log = logging.getLogger("autoplan")

SCALING_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1, 2, 4)
"""GPU counts of the report's scaling curve, as multiples of the planned count."""
SCALING_LAYOUTS = 400
"""Layouts the curve prices at each GPU count at most: the branch and bound's first ones by their time lower bound.
A count that would need more shows the best of those, and the report says so. A budget of work, not of seconds, so
that the curve is the same on any machine and under any load (the 1T GPT of Narayanan et al. on 3072 A100s needs
85 to 621 at its six counts)."""


class ScalingPoint(NamedTuple):
    """One GPU count of the scaling curve (weak scaling: the same batch per GPU as the plan)."""

    gpus: int
    samples_per_s: float | None
    """Predicted throughput of the best layout found; None when none fits (or none of those priced did)."""
    layout: str = ""
    """layouts.describe() of that layout."""
    note: str = ""
    """"" for a search that ran to the end; else how the point is bounded, or why there is none."""


def scaling_counts(num_gpus: int) -> list[int]:
    """The curve's GPU counts for a plan on `num_gpus` (SCALING_FACTORS), ascending."""
    return sorted({max(1, round(num_gpus * f)) for f in SCALING_FACTORS})


def scaling_curve(profile: ModelProfile, cluster: Cluster, training: Training, planned: Any = None,
                  max_priced: int = SCALING_LAYOUTS, context: Any = None) -> tuple[ScalingPoint, ...]:
    """The best predicted throughput at N/8 .. 4N GPUs, the same batch per GPU, pricing at most `max_priced`
    layouts at each count. `planned` (a Candidate) is the unpinned search's winner at N GPUs: its point is taken
    as is instead of searching again. `context` (the search's cost.context.Context) lends its priced modules to
    the counts with the same GPUs per node.

    Each count runs the search's branch and bound (autoplan.solve.search.explore) on one shared Context per
    node size: the chain, the tensor-parallel facts, the module tables and the memory inputs do not depend on
    the GPU count or the batch. Unlike the full search it skips the MILP refinement of the winner's split
    (only samples/s is drawn) and does not work out why nothing fits (the leanest split and a GPU count
    that would fit)."""
    _say_counts(cluster.num_gpus)
    searched = [c for c in scaling_counts(cluster.num_gpus) if c != cluster.num_gpus or planned is None]
    counts = _Counts(profile, cluster, training, max_priced, context)
    return _curve(cluster.num_gpus, {count: counts.point(count) for count in searched}, planned)


class ScalingInBackground:
    """scaling_curve's searches in a forked process, started before the caller's own search; points() collects
    them. The process takes the counts from the fewest GPUs up; once the caller's search is done, points() takes
    them from the most GPUs down until the two meet (each count is claimed once, under a lock), so both cores work
    to the end. Where a process cannot be forked (not Linux, or inside a daemonic process) or the forked one fails,
    points() searches what it did not deliver in this process, so the curve is the same either way."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training, search_planned_count: bool,
                 max_priced: int = SCALING_LAYOUTS) -> None:
        self.profile, self.cluster, self.training, self.max_priced = profile, cluster, training, max_priced
        self.counts = [c for c in scaling_counts(cluster.num_gpus) if c != cluster.num_gpus or search_planned_count]
        self._process: Any = None
        self._receiver: Any = None
        self._claimed: Any = None
        if sys.platform == "linux" and not multiprocessing.current_process().daemon:
            fork = multiprocessing.get_context("fork")
            self._claimed = fork.Array("b", len(self.counts))
            self._receiver, sender = fork.Pipe(duplex=False)
            self._process = fork.Process(target=_search_in_child, daemon=True, name="autoplan-scaling-curve",
                                         args=(sender, self._claimed, _Counts(profile, cluster, training, max_priced),
                                               self.counts))
            self._process.start()
            sender.close()

    def points(self, planned: Any = None, context: Any = None) -> tuple[ScalingPoint, ...]:
        """The curve, with `planned` (the unpinned search's winner) at the planned count when the caller gave
        search_planned_count=False. `context` serves the searches in this process."""
        _say_counts(self.cluster.num_gpus)
        counts = _Counts(self.profile, self.cluster, self.training, self.max_priced, context)
        found: dict[int, ScalingPoint] = {}
        if self._process is not None:
            for index in reversed(range(len(self.counts))):
                if not _claim(self._claimed, index):
                    break
                found[self.counts[index]] = counts.point(self.counts[index])
            found.update(self._collect())
        for count in self.counts:
            if count not in found:
                found[count] = counts.point(count)
        return _curve(self.cluster.num_gpus, found, planned)

    def cancel(self) -> None:
        """Stop the forked search (the caller's own failed or was interrupted)."""
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
        self._join()

    def _collect(self) -> dict[int, ScalingPoint]:
        """The points the forked process sent; a failure is said (points() then searches the rest itself)."""
        found: dict[int, ScalingPoint] = {}
        while True:
            try:
                kind, value = self._receiver.recv()
            except EOFError:
                kind, value = "error", f"it ended with exit code {self._process.exitcode} and no result"
            if kind == "point":
                found[value.gpus] = value
                continue
            if kind == "error":
                log.warning("scaling curve: the search in a second process failed (%s); searching here", value)
            break
        self._join()
        return found

    def _join(self) -> None:
        if self._process is not None:
            self._process.join()
            self._receiver.close()
            self._process = None


def _claim(claimed: Any, index: int) -> bool:
    """Claim count `index` for the caller: False when the other process has it."""
    with claimed.get_lock():
        if claimed[index]:
            return False
        claimed[index] = 1
        return True


def _search_in_child(sender: Any, claimed: Any, counts: "_Counts", gpu_counts: list[int]) -> None:
    """The forked process: the points of `gpu_counts` from the fewest GPUs up, each sent as it is found, until a
    count the parent has claimed; then "done" (an error: its one-line text). Ctrl-C is the parent's to handle (it
    stops this process); nothing is logged here, so the parent's log stays in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("autoplan").disabled = True
    try:
        for index, count in enumerate(gpu_counts):
            if not _claim(claimed, index):
                break
            sender.send(("point", counts.point(count)))
        message = ("done", None)
    except Exception as e:  # noqa: BLE001 - reported by the parent, which then searches the rest itself
        message = ("error", f"{type(e).__name__}: {e}")
    sender.send(message)
    sender.close()


def _say_counts(num_gpus: int) -> None:
    counts = scaling_counts(num_gpus)
    log.info("scaling curve: best layouts at %s GPUs (%s to %s times the plan's %d)", ", ".join(map(str, counts)),
             _fraction(min(SCALING_FACTORS)), _fraction(max(SCALING_FACTORS)), num_gpus)


def _curve(num_gpus: int, found: dict[int, ScalingPoint], planned: Any) -> tuple[ScalingPoint, ...]:
    """Every count's point: the searched ones from `found`, the planned count from `planned` when not searched."""
    from autoplan.solve import layouts

    points = []
    for count in scaling_counts(num_gpus):
        if count in found:
            points.append(found[count])
        elif planned is not None and count == num_gpus:
            points.append(ScalingPoint(count, planned.predicted.samples_per_s, layouts.describe(planned.parallelism)))
    return tuple(points)


class _Counts:
    """The branch and bound at other GPU counts than the plan's (the same batch per GPU), one Context per node
    size: `context` (the search's) serves the counts with its GPUs per node."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training, max_priced: int,
                 context: Any = None) -> None:
        from autoplan.layout import SUPPORTED, Layout
        from autoplan.solve import layouts

        self.profile, self.cluster, self.training, self.max_priced = profile, cluster, training, max_priced
        self.pins = pins_for_capture(Layout(), profile, warn=False)
        # by GPUs per node: the module tables' tensor-parallel links depend on it
        self.contexts: dict[int, Any] = {cluster.gpus_per_node: context} if context is not None else {}
        self.compiled = context.compiled if context is not None else layouts.compiled(self.pins, cluster, SUPPORTED)

    def point(self, count: int) -> ScalingPoint:
        from dataclasses import replace

        from autoplan.cost.context import Context, Pricing
        from autoplan.layout import SUPPORTED

        cluster, training = self.cluster, self.training
        per_node = min(cluster.gpus_per_node, count)
        if per_node not in self.contexts:
            self.contexts[per_node] = Context(self.profile, replace(cluster, gpus_per_node=per_node), training,
                                              SUPPORTED, Pricing(compiled=self.compiled))
        batch = max(1, training.global_batch_size * count // cluster.num_gpus)
        ctx = self.contexts[per_node].at(replace(cluster, num_gpus=count, gpus_per_node=per_node),
                                         replace(training, global_batch_size=batch))
        point = _scaling_point(ctx, self.pins, self.max_priced)
        log.debug("scaling curve: %d GPUs: %s", count, point)
        return point


def _fraction(factor: float) -> str:
    """1/8 for 0.125, 4 for 4.0."""
    return f"{factor:g}" if factor >= 1 else f"1/{round(1 / factor)}"


def _scaling_point(ctx, pins, max_priced: int) -> ScalingPoint:
    """The search's branch and bound at ctx's GPU count (autoplan.solve.search.explore), without the MILP
    refinement and the infeasibility explanation, stopped after `max_priced` layouts."""
    from autoplan.solve import layouts
    from autoplan.solve.search import choose, explore

    count = ctx.cluster.num_gpus
    try:
        explored = explore(ctx, pins, max_priced=max_priced, explain=False)
    except UserError as e:
        return ScalingPoint(count, None, "", str(e))
    fitting = sorted((c for c in explored.tried if c.fits), key=lambda c: c.predicted.step_time_s)
    # explore checks its bound before the budget: when the budget stopped it, the next layout could still win
    budget = f"the first {explored.priced} layouts by their time lower bound"
    if not fitting:
        why = (f"none of {budget} fits; the search did not finish" if explored.bounded else "no layout fits")
        return ScalingPoint(count, None, "", why)
    best = choose(fitting)
    note = f"bounded: best of {budget}; unpriced ones could be faster" if explored.bounded else ""
    return ScalingPoint(count, best.predicted.samples_per_s, layouts.describe(best.parallelism), note)
