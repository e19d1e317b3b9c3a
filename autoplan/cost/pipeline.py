"""Pipeline schedules: micro-batches in flight (memory) and the bubble (time).

p pipeline ranks, m micro-batches, v stages per rank (interleaved only; stage s runs on rank s % p).
- GPipe runs every forward before any backward: each stage keeps all m micro-batches.
- 1F1B (torch Schedule1F1B) warms up with p - 1 - r forwards on rank r, so it keeps p - r.
- Interleaved 1F1B (torch ScheduleInterleaved1F1B, schedules._get_warmup_ops) warms up with
  (v - 1) p + 2 (p - 1 - r) forwards, issued in rounds of p micro-batches per local stage; the
  micro-batches in flight of each local stage are counted from that order (rank 0 holds about
  (1 + 1/v) x the 1F1B amount, Narayanan et al. SC21 section 2.2).
Bubble (Narayanan et al. SC21; shared/reference/formulas.md): (p - 1) slots of the slowest rank for
GPipe and 1F1B, (p - 1) / v for interleaved, where a slot is one micro-batch through all of a rank's
stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

SCHEDULES_SUPPORTED = ("gpipe", "1f1b", "interleaved")


def interleaved_warmup(rank: int, num_ranks: int, virtual: int, num_microbatches: int) -> int:
    """Forward micro-batch-stages a rank runs before its first backward (torch _get_warmup_ops)."""
    rounds = max(1, num_microbatches // num_ranks)
    per_round = num_microbatches // rounds
    return min((virtual - 1) * per_round + 2 * (num_ranks - 1 - rank), num_microbatches * virtual)


@lru_cache(maxsize=4096)
def microbatches_in_flight(schedule: str, num_ranks: int, num_microbatches: int, stage_index: int,
                           virtual: int = 1) -> int:
    """Micro-batches whose activations the rank running `stage_index` keeps for that stage at its peak."""
    if num_ranks == 1:
        return 1  # gradient accumulation: each micro-batch's backward runs before the next forward
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b":
        return min(num_microbatches, num_ranks - stage_index)
    if schedule == "interleaved":
        rank, local = stage_index % num_ranks, stage_index // num_ranks
        rounds = max(1, num_microbatches // num_ranks)
        per_round = num_microbatches // rounds
        issued = interleaved_warmup(rank, num_ranks, virtual, num_microbatches) + 1
        cycles, rest = divmod(issued, per_round * virtual)  # forwards go in rounds of per_round per local stage
        return min(num_microbatches, cycles * per_round + min(per_round, max(0, rest - local * per_round)))
    raise ValueError(f"schedule {schedule!r} is not priced (supported: {SCHEDULES_SUPPORTED})")


def bubble_fraction(num_ranks: int, num_microbatches: int, virtual: int = 1) -> float:
    """Idle time over ideal time: (p - 1) / (v m)."""
    return (num_ranks - 1) / (virtual * num_microbatches)


@dataclass(frozen=True)
class PipelineTime:
    """One optimizer step of a pipeline whose slowest rank takes `slot_s` per micro-batch."""

    busy_s: float
    """m x the slowest rank's slot: the time the bottleneck rank is working."""
    bubble_s: float
    """Fill and drain: (p - 1) / v slots."""

    @property
    def total_s(self) -> float:
        return self.busy_s + self.bubble_s


def pipeline_time(slot_s: float, num_ranks: int, num_microbatches: int, virtual: int = 1) -> PipelineTime:
    """(m + (p - 1) / v) x slowest slot."""
    return PipelineTime(busy_s=num_microbatches * slot_s, bubble_s=(num_ranks - 1) / virtual * slot_s)
