"""Exact dynamic programs over contiguous stage splits (min-max partition of a chain).

    best[s][b] = min over a of max(best[s-1][a], cost(s, a, b))

where stage s holds modules [a, b), every module in one recompute mode. Exact when each rank runs one
stage (v = 1) and the mode is fixed; O(p n^2) at worst: for a fixed end b the start a walks down, so
the stage's time, linear memory, largest-module terms and tied groups are all updated incrementally,
and a walk stops at the first overflow (time and memory only grow as a stage takes more modules).

solve_dp checks the fast packing (split.py) and the MILP (ilp.py) in tests and gives the MILP a
warm start; min_peak_memory_split says how far from fitting an infeasible layout is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.cost.problem import Assignment, ChainProblem, Split


@dataclass(frozen=True)
class DpResult:
    assignment: Assignment
    value: float
    """The objective: slowest stage time (solve_dp) or largest stage memory (min_peak_memory_split)."""

    @property
    def split(self) -> Split:
        return self.assignment.split


class _StageTables:
    """Per-stage vectors in plain lists (fast inner loop)."""

    def __init__(self, problem: ChainProblem, stage: int, modes: tuple[str, ...]) -> None:
        model = problem.memory[stage]
        states = model.state_bytes
        self.module = [states[u] + model.activations[modes[u]][u] for u in range(problem.num_modules)]
        self.max_vectors = [list(v) for v in model.max_vectors]
        self.group = list(model.group_bytes)
        self.cut = list(model.cut_bytes)
        self.groups_of_module: list[list[int]] = [[] for _ in range(problem.num_modules)]
        for g, modules in enumerate(model.tied_group_modules):
            for u in modules:
                self.groups_of_module[u].append(g)


def _walk(problem: ChainProblem, tables: _StageTables, times: list[float], end: int, overhead: float):
    """Yield (start, time, memory) for stages ending at `end`, start descending."""
    n = problem.num_modules
    time, memory_linear = overhead, 0.0
    maxima = [0.0] * len(tables.max_vectors)
    seen: set[int] = set()
    boundary = tables.cut[end - 1] if end < n else 0.0
    for start in range(end - 1, -1, -1):
        time += times[start]
        memory_linear += tables.module[start]
        for g in tables.groups_of_module[start]:
            if g not in seen:
                seen.add(g)
                memory_linear += tables.group[g]
        for k, vec in enumerate(tables.max_vectors):
            if vec[start] > maxima[k]:
                maxima[k] = vec[start]
        yield start, time, memory_linear + sum(maxima) + boundary


def _solve(problem: ChainProblem, modes: tuple[str, ...], objective: str) -> DpResult | None:
    n, p = problem.num_modules, problem.num_stages
    if p > n:
        return None
    assert problem.virtual_stages == 1 or objective == "memory", "the DP is exact for one stage per rank"
    times = [problem.module_time_s[modes[u]][u] for u in range(n)]
    cap = problem.memory_limit_bytes
    best = [[math.inf] * (n + 1) for _ in range(p)]
    choice = [[-1] * (n + 1) for _ in range(p)]
    for s in range(p):
        tables = _StageTables(problem, s, modes)
        for end in range(s + 1, n - (p - 1 - s) + 1):
            for start, time, memory in _walk(problem, tables, times, end, problem.overhead(s)):
                if start < s:
                    break
                if objective == "time":
                    if memory > cap or time >= best[s][end]:
                        break  # both only grow as the stage takes more modules
                    cost = time
                else:
                    cost = memory
                previous = 0.0 if s == 0 else best[s - 1][start]
                if s == 0 and start != 0:
                    continue
                value = max(previous, cost)
                if value < best[s][end]:
                    best[s][end], choice[s][end] = value, start
    if math.isinf(best[p - 1][n]):
        return None
    bounds, end = [n], n
    for s in range(p - 1, -1, -1):
        end = choice[s][end]
        bounds.append(end)
    return DpResult(Assignment(Split(tuple(reversed(bounds))), modes), best[p - 1][n])


def solve_dp(problem: ChainProblem, mode: str | None = None) -> DpResult | None:
    """The split minimizing the slowest stage's time with every stage within the memory cap and every
    module in `mode` (default: the problem's first mode); None when no split fits."""
    return _solve(problem, (mode or problem.modes[0],) * problem.num_modules, "time")


def min_peak_memory_split(problem: ChainProblem) -> DpResult | None:
    """The split minimizing the largest stage memory, ignoring time and the cap, every module in its
    leanest allowed mode."""
    model = problem.memory[0]
    modes = tuple(min(problem.modes, key=lambda k: model.activations[k][u]) for u in range(problem.num_modules))
    return _solve(problem, modes, "memory")


def leanest_assignment(problem: ChainProblem) -> Assignment | None:
    """The split with the least peak stage memory (stages taken one per rank; an estimate when interleaved)."""
    found = min_peak_memory_split(problem)
    return found.assignment if found else None
