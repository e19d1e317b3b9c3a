"""Pipeline schedules: micro-batches in flight (memory) and the bubble (time).

GPipe runs every forward before any backward, so a stage keeps all m micro-batches' activations.
1F1B starts backwards as soon as the last stage can, so stage i keeps at most p - i
(Narayanan et al., SC21, section 2.2; shared/reference/formulas.md). Both have the same bubble:
(p - 1) slots of the slowest stage, i.e. a fraction (p - 1) / m of the ideal time.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES_SUPPORTED = ("gpipe", "1f1b")
"""Schedules the cost model prices today ("interleaved" comes with virtual stages)."""


def microbatches_in_flight(schedule: str, num_stages: int, num_microbatches: int, stage_index: int) -> int:
    """Micro-batches whose activations a rank of `stage_index` holds at its peak."""
    if num_stages == 1:
        return 1  # gradient accumulation: each micro-batch's backward runs before the next forward
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b":
        return min(num_microbatches, num_stages - stage_index)
    raise ValueError(f"schedule {schedule!r} is not priced (supported: {SCHEDULES_SUPPORTED})")


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle time over ideal time for GPipe and 1F1B: (p - 1) / m."""
    return (num_stages - 1) / num_microbatches


@dataclass(frozen=True)
class PipelineTime:
    """One optimizer step of a pipeline whose slowest stage takes `slot_s` per micro-batch."""

    busy_s: float
    """m x the slowest stage's slot: the time the bottleneck stage is working."""
    bubble_s: float
    """(p - 1) x slot: fill and drain."""

    @property
    def total_s(self) -> float:
        return self.busy_s + self.bubble_s


def pipeline_time(slot_s: float, num_stages: int, num_microbatches: int) -> PipelineTime:
    """(m + p - 1) x slowest slot, for GPipe and 1F1B alike."""
    return PipelineTime(busy_s=num_microbatches * slot_s, bubble_s=(num_stages - 1) * slot_s)
