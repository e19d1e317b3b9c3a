"""The stage-split problem both solvers (dp.py exact, ilp.py MILP) answer, and its solutions."""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.memory import StageMemoryModel


@dataclass(frozen=True)
class Split:
    """A partition of units 0..n-1 into contiguous non-empty stages."""

    bounds: tuple[int, ...]
    """Stage s holds units [bounds[s], bounds[s+1]); bounds[0] = 0, bounds[-1] = n."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    @staticmethod
    def from_stage_of_unit(stage_of_unit: list[int]) -> "Split":
        bounds = [0] + [u for u in range(1, len(stage_of_unit)) if stage_of_unit[u] != stage_of_unit[u - 1]]
        return Split(tuple(bounds + [len(stage_of_unit)]))


@dataclass(frozen=True)
class ChainProblem:
    """Assign the units of a chain to `num_stages` contiguous non-empty stages, minimizing the
    slowest stage's time per micro-batch, with every stage's memory <= memory_cap_bytes.

    Stage memory depends on the stage index (micro-batches in flight), hence one model per stage."""

    unit_time_s: tuple[float, ...]
    """Forward + backward time of each unit for one micro-batch, seconds."""
    memory: tuple[StageMemoryModel, ...]
    """memory[s]: the memory model of stage s (len = number of stages)."""
    memory_cap_bytes: float
    """Usable memory per rank, bytes."""

    @property
    def num_units(self) -> int:
        return len(self.unit_time_s)

    @property
    def num_stages(self) -> int:
        return len(self.memory)

    def stage_time(self, start: int, end: int) -> float:
        return sum(self.unit_time_s[start:end])

    def stage_memory(self, stage: int, start: int, end: int) -> float:
        return self.memory[stage].total(start, end)

    def bottleneck(self, split: Split) -> float:
        return max(self.stage_time(a, b) for a, b in split.ranges())

    def peak_memory(self, split: Split) -> list[float]:
        return [self.stage_memory(s, a, b) for s, (a, b) in enumerate(split.ranges())]

    def fits(self, split: Split, tolerance: float = 1e-9) -> bool:
        return all(m <= self.memory_cap_bytes * (1 + tolerance) for m in self.peak_memory(split))

    def time_lower_bound(self) -> float:
        """No split beats the largest unit or an even share of the total."""
        return max(max(self.unit_time_s), sum(self.unit_time_s) / self.num_stages)

    def memory_lower_bound(self) -> float:
        """A bound on the peak stage memory of any split, cheap enough to prune before solving:
        the larger of the average over stages of their smallest possible share and the cheapest
        stage any single unit could sit in (boundary activations left out: they depend on the cut)."""
        if self.num_stages == 1:
            return self.memory[0].total(0, self.num_units)
        n, p = self.num_units, self.num_stages
        groups = range(len(self.memory[0].group_bytes))
        cheapest_unit = [min(m.unit_bytes[u] for m in self.memory) for u in range(n)]
        cheapest_group = [min(m.group_bytes[g] for m in self.memory) for g in groups]
        average = (sum(cheapest_unit) + sum(cheapest_group)) / p

        def alone(m: StageMemoryModel, u: int) -> float:
            tied = sum(m.group_bytes[g] for g in groups if u in m.tied_group_units[g])
            return m.unit_bytes[u] + sum(v[u] for v in m.max_vectors) + tied

        return max(average, max(min(alone(m, u) for m in self.memory) for u in range(n)))
