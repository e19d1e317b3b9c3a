"""The stage-split problem the solvers answer (split.py fast, dp.py exact DP, ilp.py MILP).

Modules 0..n-1 of the chain go to S = p x v contiguous non-empty stages in order; stage s runs on
pipeline rank layout.stage_rank(s, p, placement) (s % p, or the V of zbv and dualpipev). Each module also gets a
recompute mode from ChainProblem.modes. A rank's time per micro-batch is the sum over its stages of their modules' times
(plus each stage's constant point-to-point overhead); the objective is the slowest rank. A rank's
memory is the sum over its stages of their linear, tied-group and boundary bytes, plus the largest
transient term of any module it holds (one module runs backward at a time); it must fit the cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from autoplan.cost.memory import StageMemoryModel
from autoplan.layout import rank_stages, stage_rank

MEMORY_TOLERANCE = 1e-9
"""Relative slack on the memory cap that every solver and ChainProblem.fits allow alike (floating-point sums):
the packing, the DP and the MILP accept an assignment exactly when ChainProblem.fits does."""


@dataclass(frozen=True)
class Split:
    """A partition of modules 0..n-1 into contiguous non-empty stages."""

    bounds: tuple[int, ...]
    """Stage s holds modules [bounds[s], bounds[s+1]); bounds[0] = 0, bounds[-1] = n."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    @staticmethod
    def from_stage_of_module(stage_of_module: list[int]) -> "Split":
        bounds = [0] + [u for u in range(1, len(stage_of_module)) if stage_of_module[u] != stage_of_module[u - 1]]
        return Split(tuple(bounds + [len(stage_of_module)]))


@dataclass(frozen=True)
class Assignment:
    """A solution: the stage split and each module's recompute mode."""

    split: Split
    modes: tuple[str, ...]
    """Recompute mode of each module ("none", "selective", "full")."""


@dataclass(frozen=True)
class ChainProblem:
    """Assign modules to stages and recompute modes, minimizing the slowest rank's time per micro-batch
    with every rank's memory <= memory_cap_bytes."""

    module_time_s: dict[str, tuple[float, ...]]
    """Recompute mode -> forward + backward (+ recompute) time of each module per micro-batch, seconds."""
    memory: tuple[StageMemoryModel, ...]
    """memory[s]: the memory model of stage s (len = number of stages = p x v)."""
    memory_cap_bytes: float
    """Usable memory per rank, bytes."""
    pp: int = 0
    """Pipeline ranks p (0 means one rank per stage)."""
    modes: tuple[str, ...] = ("none",)
    """Recompute modes the solver may give a module."""
    stage_overhead_s: tuple[float, ...] = ()
    """Constant time per micro-batch of each stage (point-to-point sends), seconds; empty = none."""
    signature: tuple[int, ...] = ()
    """Modules with equal signatures cost the same (identical layers); empty = all distinct."""
    placement: str = "loop"
    """Which rank runs each stage (autoplan.layout.Schedule.placement): "loop" s % p, "v" the V of zbv and
    dualpipev."""

    @cached_property
    def signatures(self) -> tuple[int, ...]:
        return self.signature or tuple(range(self.num_modules))

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs [start, end) of consecutive identical modules (same signature, and the same times and
        memory terms, boundary bytes included: the MILP prices a run's modules by its first); modules of tied
        groups stand alone."""
        tied = {u for modules in self.memory[0].tied_group_modules for u in modules}
        sig = self.signatures
        out, start = [], 0
        for u in range(1, self.num_modules + 1):
            if u == self.num_modules or sig[u] != sig[start] or u in tied or start in tied \
                    or self._terms(u, u < self.num_modules - 1) != self._terms(start, u < self.num_modules - 1):
                out.append((start, u))
                start = u
        return out

    def _terms(self, u: int, boundary: bool) -> tuple:
        """Module u's times, linear and transient bytes and (with `boundary`; the last module has none) the bytes
        a stage ending after it keeps, on every distinct stage model."""
        times = tuple(self.module_time_s[k][u] for k in self.modes)
        memory = tuple((m.state_bytes[u], tuple(m.activations[k][u] for k in self.modes),
                        tuple(vec[u] for vec in m.max_vectors), m.cut_bytes[u] if boundary else None)
                       for m in self.leanest_stages())
        return times, memory

    @property
    def memory_limit_bytes(self) -> float:
        """The cap with MEMORY_TOLERANCE: what fits, for every solver."""
        return self.memory_cap_bytes * (1 + MEMORY_TOLERANCE)

    @property
    def num_modules(self) -> int:
        return len(next(iter(self.module_time_s.values())))

    @property
    def num_stages(self) -> int:
        return len(self.memory)

    @property
    def ranks(self) -> int:
        return self.pp or self.num_stages

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.ranks

    def overhead(self, stage: int) -> float:
        return self.stage_overhead_s[stage] if self.stage_overhead_s else 0.0

    def stages_of_rank(self, rank: int) -> list[int]:
        return rank_stages(rank, self.ranks, self.virtual_stages, self.placement)

    def stage_rank(self, stage: int) -> int:
        """The rank that runs `stage` (autoplan.layout.stage_rank)."""
        return stage_rank(stage, self.ranks, self.placement)

    def uniform(self, split: Split, mode: str | None = None) -> Assignment:
        return Assignment(split, (mode or self.modes[0],) * self.num_modules)

    def stage_time(self, start: int, end: int, modes: tuple[str, ...]) -> float:
        return sum(self.module_time_s[modes[u]][u] for u in range(start, end))

    def rank_times(self, a: Assignment) -> list[float]:
        ranges = a.split.ranges()
        return [sum(self.stage_time(*ranges[s], a.modes) + self.overhead(s) for s in self.stages_of_rank(r))
                for r in range(self.ranks)]

    def bottleneck(self, a: Assignment) -> float:
        return max(self.rank_times(a))

    def rank_breakdown(self, rank: int, a: Assignment) -> dict[str, float]:
        """Bytes per category on `rank`: its stages' sums, the largest transient term once."""
        out: dict[str, float] = {}
        transient: dict[str, float] = {}
        ranges = a.split.ranges()
        for s in self.stages_of_rank(rank):
            start, end = ranges[s]
            for c, v in self.memory[s].breakdown(start, end, a.modes).items():
                if c in self.memory[s].largest_module:
                    part = max(self.memory[s].largest_module[c][start:end])
                    transient[c] = max(transient.get(c, 0.0), part)
                    v -= part
                out[c] = out.get(c, 0.0) + v
        for c, v in transient.items():
            out[c] = out.get(c, 0.0) + v
        return out

    def peak_memory(self, a: Assignment) -> list[float]:
        """Memory of each rank."""
        return [sum(self.rank_breakdown(r, a).values()) for r in range(self.ranks)]

    def fits(self, a: Assignment) -> bool:
        """Every rank's memory (rank_breakdown: the one memory model the plan reports) within the cap."""
        return all(m <= self.memory_limit_bytes for m in self.peak_memory(a))

    @cached_property
    def fastest_module_time(self) -> tuple[float, ...]:
        return tuple(map(min, zip(*(self.module_time_s[m] for m in self.modes))))

    def time_lower_bound(self) -> float:
        """No assignment beats an even share of the fastest times, or a rank's single largest module."""
        share = (sum(self.fastest_module_time) + sum(self.overhead(s) for s in range(self.num_stages))) / self.ranks
        return max(max(self.fastest_module_time), share)

    def leanest_stages(self) -> list[StageMemoryModel]:
        """One stage per distinct set of shared vectors: the one keeping the fewest micro-batches."""
        lean: dict[tuple, StageMemoryModel] = {}
        for m in self.memory:
            key = (id(m.per_module), id(m.activations_per_microbatch), id(m.largest_module), id(m.per_tied_group))
            if key not in lean or m.in_flight < lean[key].in_flight:
                lean[key] = m
        return list(lean.values())

    def memory_lower_bound(self) -> float:
        """A bound on the peak rank memory of any assignment, cheap enough to prune before solving (the function
        memory_lower_bound: what it reads of the problem is its leanest stages, its ranks and modes)."""
        if self.num_stages == 1:
            return single_stage_memory(self.memory[0], self.modes, self.num_modules)
        return memory_lower_bound(self.leanest_stages(), self.ranks, self.modes, self.num_modules)


def single_stage_memory(stage: StageMemoryModel, modes: tuple[str, ...], n: int) -> float:
    """The memory of a problem's one stage holding all `n` modules, each in its leanest mode: the exact minimum."""
    leanest = tuple(min(modes, key=lambda k: stage.activations[k][u]) for u in range(n))
    return stage.total(0, n, leanest)


def memory_lower_bound(lean: list[StageMemoryModel], ranks: int, modes: tuple[str, ...], n: int) -> float:
    """A bound on the peak rank memory of any assignment of a problem with more than one stage, from its leanest
    stages (ChainProblem.leanest_stages: one per distinct set of shared vectors, the first keeping the fewest
    micro-batches) over `ranks` pipeline ranks: the average over ranks of the leanest bytes of every module and
    tied group, and the cheapest place any single module could sit (boundary activations left out: they depend on
    the cut; `n` modules). It reads only those stages, so that a search can work it out, and remember it, before
    building the problem (cost/evaluate.py memory_lower_bound)."""
    p, first = ranks, lean[0]
    groups = range(len(first.group_bytes))
    linear = [(m.module_bytes(k), m.largest_bytes) for m in lean for k in modes]
    leanest = [min(column) for column in zip(*(module for module, _ in linear))]  # per module, over (stage, mode)
    cheapest_group = [min(m.group_bytes[g] for m in lean) for g in groups]
    average = (sum(leanest) + sum(cheapest_group)) / p
    tied = [sum(first.group_bytes[g] for g in groups if u in first.tied_group_modules[g]) for u in range(n)]
    alone = [min(column) + t for column, t in zip(
        zip(*(tuple(a + b for a, b in zip(module, largest)) for module, largest in linear)), tied)]
    return max(average, max(alone))
