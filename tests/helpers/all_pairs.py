"""All-pairs covering arrays: a few cases in which every pair of values of two factors that can occur together
does occur at least once (tests/test_pairs_matrix.py builds the parity matrix of the plan vocabulary with it).

A factor's value may be None in a case ("does not apply": sequence parallelism without tensor parallelism); pairs
are formed of the values that apply. A case is allowed or refused by a function returning the reasons it breaks
(layout rules); a pair that no allowed case holds is listed with the reasons of the case that holds it and breaks
the fewest. The greedy choice (AETG-style, over every allowed case) takes the case covering the most pairs not
yet covered for its cost.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Case = Mapping[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]


@dataclass(frozen=True)
class Factor:
    name: str
    values: tuple[Any, ...]
    applies: Callable[[Case], bool] | None = None
    """Whether this factor's value means anything beside the others' (None: always); where not, it is None."""


@dataclass(frozen=True)
class Covering:
    cases: list[dict[str, Any]]
    """The chosen cases, in the order chosen."""
    refused: dict[Pair, list[str]]
    """Each pair no allowed case holds, with the reasons of a case holding it that breaks the fewest."""
    pairs: set[Pair]
    """Every pair some allowed case holds (each covered by `cases`)."""


def all_cases(factors: Sequence[Factor]) -> list[dict[str, Any]]:
    """Every combination of values, with the values that do not apply set to None (each combination once)."""
    seen, out = set(), []
    for values in itertools.product(*(f.values for f in factors)):
        case = dict(zip((f.name for f in factors), values))
        for f in factors:
            if f.applies is not None and not f.applies(case):
                case[f.name] = None
        key = tuple(case.values())
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def pairs_of(case: Case, factors: Sequence[Factor]) -> list[Pair]:
    items = [(f.name, case[f.name]) for f in factors if case[f.name] is not None]
    return list(itertools.combinations(items, 2))


def covering_array(factors: Sequence[Factor], reasons: Callable[[Case], list[str]],
                   cost: Callable[[Case], float] = lambda case: 1.0,
                   allowed_extra: Callable[[Case], bool] = lambda case: True,
                   required: Sequence[Callable[[Case], bool]] = (),
                   costly: Callable[[Case], bool] = lambda case: False) -> Covering:
    """Cases covering every pair that an allowed case holds. A case is allowed when `reasons` gives none and
    `allowed_extra` (what the caller can afford, e.g. ranks) accepts it. Each of `required` (more than pairs:
    a triple, say) holds for at least one chosen case, or ValueError. Costly cases (a slow feature) cover the
    pairs only they can hold, and no others: the rest are left to the other cases."""
    cases = all_cases(factors)
    broken = [reasons(case) for case in cases]
    index: dict[Pair, int] = {}
    members = [[index.setdefault(p, len(index)) for p in pairs_of(case, factors)] for case in cases]
    allowed = [i for i, case in enumerate(cases) if not broken[i] and allowed_extra(case)]
    fewest: dict[int, int] = {}
    for i, pair_ids in enumerate(members):
        for p in pair_ids:
            if p not in fewest or len(broken[i]) < len(broken[fewest[p]]):
                fewest[p] = i
    pair_of = {p: pair for pair, p in index.items()}
    coverable = sorted({p for i in allowed for p in members[i]})
    coverable_set = set(coverable)
    refused = {pair_of[p]: broken[i] for p, i in fewest.items() if p not in coverable_set}

    width = max((len(m) for m in members), default=0)
    table = np.full((len(allowed), width), len(index), dtype=np.int64)  # the padding id is never uncovered
    for row, i in enumerate(allowed):
        table[row, :len(members[i])] = members[i]
    uncovered = np.zeros(len(index) + 1, dtype=bool)
    uncovered[coverable] = True
    costs = np.array([cost(cases[i]) for i in allowed])
    chosen: list[dict[str, Any]] = []

    def choose(candidates: np.ndarray, counted: np.ndarray) -> None:
        """Take the candidate (an allowed row) covering the most uncovered pairs of those `counted`, the cheapest
        of those."""
        gains = (uncovered & counted)[table[candidates]].sum(axis=1)
        best = candidates[gains == gains.max()]
        row = int(best[np.argmin(costs[best])])
        chosen.append(dict(cases[allowed[row]]))
        uncovered[table[row]] = False

    every_pair = np.ones(len(index) + 1, dtype=bool)
    holding = np.array([[holds(cases[i]) for holds in required] for i in allowed], dtype=bool).reshape(
        len(allowed), len(required))
    missing = np.ones(len(required), dtype=bool)
    for k in range(len(required)):
        if not holding[:, k].any():
            raise ValueError(f"no allowed case satisfies required[{k}]")
    while missing.any():  # first the cases holding the most of the required ones not yet held
        counts = holding[:, missing].sum(axis=1)
        choose(np.flatnonzero(counts == counts.max()), every_pair)
        missing &= ~np.array([holds(chosen[-1]) for holds in required], dtype=bool)
    costly_rows = np.array([costly(cases[i]) for i in allowed], dtype=bool)
    needs_costly = np.zeros(len(index) + 1, dtype=bool)  # pairs only costly cases hold
    needs_costly[coverable] = True
    needs_costly[table[~costly_rows]] = False
    while (uncovered & needs_costly).any():  # as few costly cases as the greedy finds, for their own pairs
        choose(np.flatnonzero(costly_rows), needs_costly)
    while uncovered.any():
        choose(np.flatnonzero(~costly_rows), every_pair)
    return Covering(chosen, refused, {pair_of[p] for p in coverable})
