"""Fast stage split with per-module recompute: greedy packing inside a bisection on the bottleneck.

For a bottleneck T, stages are packed left to right, each taking as many modules as fit in T / v
(v stages per rank, so every rank fits T) and in what memory its rank has left. A stage's cost is exact for a
uniform recompute mode; with several modes allowed, modules start with no recompute and the stage buys
the memory it lacks at the cheapest time per byte (the lower convex hull of each module's
(bytes saved, time added) options, a greedy multiple-choice knapsack). Identical modules (same
signature) are taken in runs, by binary search on how many fit, so a pass costs O(stages x runs).
Packing is exact for the min-max split when a stage's feasibility only shrinks as it takes more modules
(a left-shrunk stage stays feasible); the MILP (ilp.py) then refines the winner.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from functools import cached_property
from itertools import accumulate

from autoplan.cost.problem import Assignment, ChainProblem, Split

BISECTION_TOLERANCE = 1e-3
"""Relative width at which the bisection on the bottleneck stops (the reported bottleneck is the
exact one of the split found)."""


def _prefix(values) -> list[float]:
    return [0.0, *accumulate(values)]


class _Tables:
    """Prefix sums over modules (per stage where the memory model differs by stage)."""

    def __init__(self, problem: ChainProblem, signature: tuple[int, ...]) -> None:
        self.p = problem
        self.n = problem.num_modules
        self.modes = problem.modes
        self.time = {m: _prefix(problem.module_time_s[m]) for m in self.modes}
        self.signature = signature
        self.sigs = sorted(set(signature))
        self.first_of = {s: signature.index(s) for s in self.sigs}
        self.count = {s: _prefix(1 if x == s else 0 for x in signature) for s in self.sigs}
        self.runs = []
        start = 0
        for u in range(1, self.n + 1):
            if u == self.n or signature[u] != signature[start]:
                self.runs.append((start, u))
                start = u
        self.run_of = [0] * self.n
        for i, (a, b) in enumerate(self.runs):
            for u in range(a, b):
                self.run_of[u] = i
        self._stage: dict[int, dict] = {}
        self._shared: dict[tuple, dict] = {}
        self._evaluated: dict[tuple, tuple | None] = {}
        self._hulls: dict[tuple[int, int], list[tuple]] = {}

    def stage(self, s: int) -> dict:
        """Prefix sums of stage s: shared with every stage built from the same vectors, scaled by f."""
        if s not in self._stage:
            model = self.p.memory[s]
            key = (id(model.per_module), id(model.activations_per_microbatch), id(model.largest_module),
                   id(model.per_tied_group), id(model.cut_per_microbatch))
            if key not in self._shared:
                self._shared[key] = {
                    "state": _prefix(model.state_bytes),
                    "act": {m: _prefix(model.activations_per_microbatch[m]) for m in self.modes},
                    "act_vec": model.activations_per_microbatch,
                    "largest": [list(vec) for vec in model.max_vectors],
                    "groups": list(zip(model.group_bytes, model.tied_group_modules)),
                    "cut": model.cut_per_microbatch,
                    "maxima": {},  # (a, b) -> the largest term of each category over [a, b): _largest
                }
            self._stage[s] = {**self._shared[key], "f": model.in_flight}
        return self._stage[s]

    def evaluate(self, s: int, a: int, b: int, mode: str | None, cap: float, prior_max: tuple[float, ...] = ()):
        """(time, counts) of stage s holding [a, b) within `cap`, or None when it cannot fit.
        counts: {(signature, mode): modules} of the recompute chosen (mixed) or the uniform mode (read only).
        `prior_max` holds the largest transient term of each category (StageMemoryModel.largest_module) the rank
        already has from its earlier stages (() for none). Remembered: the
        packings of one split (greedy_split's bisection over stage times) ask again for the same stages."""
        key = (s, a, b, mode, cap, prior_max)
        if key not in self._evaluated:
            self._evaluated[key] = self._evaluate(s, a, b, mode, cap, prior_max)
        return self._evaluated[key]

    def _evaluate(self, s: int, a: int, b: int, mode: str | None, cap: float, prior_max: tuple[float, ...]):
        t = self.stage(s)
        f = t["f"]
        memory = t["state"][b] - t["state"][a] + sum(_largest(t, a, b, prior_max))
        memory += sum(g for g, modules in t["groups"] if any(a <= u < b for u in modules))
        if b < self.n:
            memory += t["cut"][b - 1] * f
        overhead = self.p.overhead(s)
        if mode is not None:
            memory += (t["act"][mode][b] - t["act"][mode][a]) * f
            if memory > cap:
                return None
            return self.time[mode][b] - self.time[mode][a] + overhead, {("*", mode): b - a}
        base = self.modes[0]
        memory += (t["act"][base][b] - t["act"][base][a]) * f
        time = self.time[base][b] - self.time[base][a] + overhead
        need = memory - cap
        if need <= 0:
            return time, {}
        increments = []
        for sig in self.sigs:
            count = self.count[sig][b] - self.count[sig][a]
            if count:
                increments += [(slope, saved, added, count, key) for slope, saved, added, key in self._hull(s, sig)]
        chosen: dict[tuple, int] = {}
        for _, saved, added, count, key in sorted(increments, key=lambda x: x[0]):
            modules = min(count, math.ceil(need / saved))
            chosen[key] = modules
            need -= modules * saved
            time += modules * added
            if need <= 0:
                return time, _modes_from_increments(chosen)
        return None

    def stage_memory(self, s: int, a: int, b: int, mode: str | None, counts: dict) -> tuple[float, tuple[float, ...]]:
        """(linear bytes, largest transient bytes of each category) of stage s holding [a, b) with the recompute
        chosen."""
        t = self.stage(s)
        base, f = mode or self.modes[0], t["f"]
        linear = t["state"][b] - t["state"][a] + (t["act"][base][b] - t["act"][base][a]) * f
        linear += sum(g for g, modules in t["groups"] if any(a <= u < b for u in modules))
        linear += t["cut"][b - 1] * f if b < self.n else 0.0
        if mode is None:
            for (sig, m), modules in counts.items():
                u = self.first_of[sig]
                linear -= modules * (t["act_vec"][base][u] - t["act_vec"][m][u]) * f
        return linear, _largest(t, a, b, ())

    @cached_property
    def rank_of_stage(self) -> list[tuple[int, int]]:
        """(rank, how many of that rank's stages come after it) of each stage."""
        out = []
        for s in range(self.p.num_stages):
            rank = self.p.stage_rank(s)
            out.append((rank, sum(1 for t in self.p.stages_of_rank(rank) if t > s)))
        return out

    @cached_property
    def even_stage_bytes(self) -> float:
        """Linear bytes of an average stage in its leanest modes (the room a future stage needs)."""
        if self.p.virtual_stages == 1:
            return 0.0
        total = 0.0
        for s in range(self.p.num_stages):
            t = self.stage(s)
            total += t["state"][self.n] + t["f"] * min(t["act"][m][self.n] for m in self.modes)
        return total / self.p.num_stages ** 2

    def _hull(self, s: int, sig: int) -> list[tuple]:
        """Increments (time per byte, bytes saved, time added, (sig, mode)) along the lower convex hull of one module's
        recompute options on stage s (bytes saved, time added) from (0, 0), worked out once per stage and module."""
        if (s, sig) in self._hulls:
            return self._hulls[s, sig]
        t = self.stage(s)
        u, base = self.first_of[sig], self.modes[0]
        points = [((t["act_vec"][base][u] - t["act_vec"][m][u]) * t["f"],
                   self.p.module_time_s[m][u] - self.p.module_time_s[base][u], m) for m in self.modes[1:]]
        hull, at_saved, at_added = [], 0.0, 0.0
        while True:
            ahead = [((dt - at_added) / (dm - at_saved), -dm, dm, dt, m)
                     for dm, dt, m in points if dm > at_saved * (1 + 1e-12) + 1e-9]
            if not ahead:
                self._hulls[s, sig] = hull
                return hull
            slope, _, dm, dt, m = min(ahead)
            hull.append((slope, dm - at_saved, dt - at_added, (sig, m)))
            at_saved, at_added = dm, dt


def _largest(t: dict, a: int, b: int, prior_max: tuple[float, ...]) -> tuple[float, ...]:
    """The largest transient term of each category on a rank whose stage holds [a, b), its earlier stages'
    `prior_max` included: each category's maximum taken on its own, as StageMemoryModel.breakdown and
    ChainProblem.rank_breakdown take it (the sum of the per-module sums' maximum would be smaller when the
    categories peak on different modules: one module's working set, another's gathered parameters)."""
    maxima = t["maxima"].get((a, b))
    if maxima is None:
        maxima = t["maxima"][a, b] = tuple(max(vec[a:b]) for vec in t["largest"])
    return _largest_of(prior_max, maxima)


def _largest_of(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, ...]:
    """Elementwise maximum of two per-category maxima, () standing for none."""
    return tuple(map(max, x, y)) if x and y else x or y


def _modes_from_increments(chosen: dict[tuple, int]) -> dict[tuple, int]:
    """Modules per (signature, final mode): a module that took a later increment ends in that mode."""
    out: dict[tuple, int] = {}
    by_sig: dict[int, list[tuple[str, int]]] = {}
    for (sig, mode), modules in chosen.items():
        by_sig.setdefault(sig, []).append((mode, modules))
    for sig, steps in by_sig.items():
        taken_after = 0
        for mode, modules in reversed(steps):
            out[(sig, mode)] = modules - taken_after
            taken_after = modules
    return {k: v for k, v in out.items() if v > 0}


def _pack(tables: _Tables, stage_time: float, cap: float, mode: str | None) -> list[tuple[int, int, dict]] | None:
    """Greedy left-to-right packing; each stage takes the furthest end that fits. A rank's later stages
    (interleaved) find the memory its earlier ones used taken, and each stage leaves room for an even
    share of the rank's stages still to come."""
    n, stages, ranks = tables.n, tables.p.num_stages, tables.p.ranks
    used, largest = [0.0] * ranks, [()] * ranks
    share = tables.even_stage_bytes
    out, start = [], 0
    for s in range(stages):
        rank, later = tables.rank_of_stage[s]
        room = cap - used[rank] - later * share
        last = n - (stages - 1 - s)
        best = None
        end = start + 1 if s < stages - 1 else last  # the last stage must end at n: shorter ends cannot pack
        while end <= last:
            run_end = min(tables.runs[tables.run_of[end - 1]][1], last)
            fits = _within(tables.evaluate(s, start, run_end, mode, room, largest[rank]), stage_time)
            if fits is not None:
                best, end = (run_end, fits), run_end + 1
                continue
            lo, hi = end, run_end - 1  # the run's modules are identical: binary search how many fit
            while lo <= hi:
                mid = (lo + hi) // 2
                fits = _within(tables.evaluate(s, start, mid, mode, room, largest[rank]), stage_time)
                if fits is not None:
                    best, lo = (mid, fits), mid + 1
                else:
                    hi = mid - 1
            break
        if best is None:
            return None
        end, counts = best
        if ranks < stages:
            linear, peak = tables.stage_memory(s, start, end, mode, counts)
            used[rank] += linear
            largest[rank] = _largest_of(largest[rank], peak)
        out.append((start, end, counts))
        start = end
    return out if start == n else None


def _within(found, limit: float):
    """The counts of a stage _Tables.evaluate found fitting in memory, if its time is within `limit` (else None)."""
    if found is None or found[0] > limit * (1 + 1e-12):
        return None
    return found[1]


def _assignment(tables: _Tables, packed, mode: str | None) -> Assignment:
    modes = [mode or tables.modes[0]] * tables.n
    for a, b, counts in packed:
        if mode is not None:
            continue
        for (sig, m), modules in counts.items():
            for u in range(a, b):
                if modules and tables.signature[u] == sig and modes[u] == tables.modes[0]:
                    modes[u], modules = m, modules - 1
    return Assignment(Split(tuple([0] + [b for _, b, _ in packed])), tuple(modes))


class Slower(Exception):
    """Packing fails even at the cutoff: this layout cannot beat the one the cutoff came from."""


def greedy_split(problem: ChainProblem, mode: str | None = None, cutoff: float | None = None) -> Assignment | None:
    """The best assignment the packing finds: every module in `mode`, or (None) each module's mode chosen
    among problem.modes; None when nothing fits (or there are more stages than modules). With `cutoff`
    (a rank time per micro-batch), raises Slower when no packing within it exists."""
    n, stages, v = problem.num_modules, problem.num_stages, problem.virtual_stages
    if stages > n:
        return None
    cap = problem.memory_limit_bytes
    low = (problem.time_lower_bound() if mode is None else _uniform_lower_bound(problem, mode)) / v
    limit, step, found = low, 0.01, None
    if cutoff is not None:  # a tighter limit may pack where a loose one ran its ranks out of memory
        tries = [x for x in (low * (1 + step), (low + cutoff / v) / 2, cutoff / v) if x <= cutoff / v]
        tries = [x for x in tries if _reaches_end_in_time(problem, mode, x)]
        if not tries:
            raise Slower()  # no packing within the cutoff, by time alone (the memory-blind packing cannot)
        tables = _Tables(problem, problem.signatures)
        found = next((p for p in (_pack(tables, x, cap, mode) for x in tries) if p is not None), None)
        if found is None:
            raise Slower()
    else:
        tables = _Tables(problem, problem.signatures)
    everything = sum(max(problem.module_time_s[m][u] for m in problem.modes) for u in range(n)) + \
        sum(problem.overhead(s) for s in range(stages))
    while found is None:  # grow geometrically from the lower bound: a loose limit packs memory-hungry
        found = _pack(tables, limit, cap, mode)
        if found is None:
            if limit >= everything:
                return None
            low, limit, step = limit, min(everything, limit * (1 + step)), step * 2
    high = max(_stage_times(tables, found, mode))
    while high - low > BISECTION_TOLERANCE * high:
        middle = (low + high) / 2
        trial = _pack(tables, middle, cap, mode)
        if trial is None:
            low = middle
        else:
            high, found = max(_stage_times(tables, trial, mode)), trial
    return _assignment(tables, found, mode)


def _reaches_end_in_time(problem: ChainProblem, mode: str | None, stage_time: float) -> bool:
    """Whether a packing with every stage within `stage_time` can exist, by time alone: the packing's greedy
    (_pack) with memory left out, each stage taking the furthest end its time allows, and none where its first
    module alone is over the limit (a later stage, with less point-to-point overhead, may take it). False means
    _pack finds nothing at `stage_time`: stage by stage its end is never past this one's (a stage within memory
    is within time, and a stage's time only grows with its modules, the recompute memory buys included), so it
    cannot reach the last module either. Cheap: prefix sums and a bisection per stage, no memory tables."""
    n, stages = problem.num_modules, problem.num_stages
    times = _prefix(problem.module_time_s[mode or problem.modes[0]])
    limit = stage_time * (1 + 1e-12)
    start = 0
    for s in range(stages):
        last = n - (stages - 1 - s)
        overhead = problem.overhead(s)
        end = bisect_right(times, times[start] - overhead + limit, start, last + 1) - 1
        while end > start and times[end] - times[start] + overhead > limit:
            end -= 1  # the bisection's sum differs from the packing's difference of prefix sums by rounding
        while end < last and times[end + 1] - times[start] + overhead <= limit:
            end += 1
        start = max(start, end)
    return start == n


def _stage_times(tables: _Tables, packed, mode: str | None) -> list[float]:
    return [tables.evaluate(s, a, b, mode, math.inf)[0] if mode else _mixed_time(tables, s, a, b, counts)
            for s, (a, b, counts) in enumerate(packed)]


def _mixed_time(tables: _Tables, s: int, a: int, b: int, counts: dict) -> float:
    base = tables.modes[0]
    time = tables.time[base][b] - tables.time[base][a] + tables.p.overhead(s)
    for (sig, m), modules in counts.items():
        u = tables.first_of[sig]
        time += modules * (tables.p.module_time_s[m][u] - tables.p.module_time_s[base][u])
    return time


def _uniform_lower_bound(problem: ChainProblem, mode: str) -> float:
    times = problem.module_time_s[mode]
    overhead = sum(problem.overhead(s) for s in range(problem.num_stages))
    return max(max(times), (sum(times) + overhead) / problem.ranks)
