"""The alternatives a plan lists beside its choice: the next fastest priced layouts, and on a model with expert
layers the fastest of the other expert split than the chosen one."""

from __future__ import annotations

from typing import Any

from autoplan.plan import Alternative

NEXT_BEST = 5
"""Alternatives a plan lists by step time (then the fastest of the other expert split, when not among them)."""


def alternatives(candidates, best) -> tuple[Alternative, ...]:
    """plan.json's alternatives: the NEXT_BEST fastest priced candidates other than `best` (fitting ones first),
    then the fastest of the other expert split (fastest_of_the_other_expert_split) unless already listed."""
    listed = tuple(Alternative.of(c) for c in next_best(candidates, best, NEXT_BEST))
    return listed + tuple(Alternative.of(c) for c in fastest_of_the_other_expert_split(candidates, best)
                          if Alternative.of(c) not in listed)


def next_best(candidates, best, count: int) -> list[Any]:
    """The `count` fastest priced candidates other than `best`, fitting ones first."""
    others = [c for c in candidates if c is not best and c.predicted is not None]
    others.sort(key=lambda c: (not c.fits, c.predicted.step_time_s))
    return others[:count]


def fastest_of_the_other_expert_split(candidates, best) -> list[Any]:
    """On a model with expert layers, the fastest priced layout of the other kind than the plan's: with ep=1 when
    the plan splits the experts (ep > 1), with ep > 1 when it does not (what the report and the summary measure
    expert parallelism by); else nothing."""
    return fastest_by_expert_split(candidates, exclude_ep=best.parallelism.ep)


def fastest_by_expert_split(candidates, exclude_ep: int | None = None) -> list[Any]:
    """The fastest priced candidate with expert parallelism (ep > 1) and the fastest without (ep = 1), fitting ones
    first, in that order; a kind none has is left out, and so is the kind with ep equal to `exclude_ep` (1: leave out
    ep = 1; any other value: leave out ep > 1)."""
    out = []
    for split in (True, False):
        if exclude_ep is not None and (exclude_ep > 1) == split:
            continue
        kind = [c for c in candidates if c.predicted is not None and (c.parallelism.ep > 1) == split]
        if kind:
            out.append(min(kind, key=lambda c: (not c.fits, c.predicted.step_time_s)))
    return out
