"""The predicted schedule of one optimizer step, as timed events per pipeline rank.

One function, `step_schedule`, produces the events; the HTML Gantt chart and trace.json both draw
them, so the two can never disagree. The schedule is a list-scheduling simulation: every rank runs
its micro-batch operations in the order its schedule prescribes (GPipe, 1F1B, interleaved 1F1B, and the
zero-bubble ones, whose backward runs as an input-gradient pass B and a later weight-gradient pass W),
each as soon as its inputs have arrived and the rank is free (autoplan.cost.pipeline.simulate, the
simulation the cost model prices pipelines with).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.pipeline import StageCost, simulate
from autoplan.layout import SCHEDULE_BY_NAME, stage_rank
from autoplan.plan import Plan

FORWARD_SHARE = 1 / 3
"""Share of a stage's forward+backward time spent in forward when a plan does not record it: backward
costs about twice the forward (Narayanan et al., SC21; shared/reference/formulas.md)."""

COMPUTE = "compute"
COMMUNICATION = "communication"
RECEIVE = "receive"
LANES = (COMPUTE, COMMUNICATION, RECEIVE)
COMPUTE_KINDS = {"forward": "F", "backward": "B", "input_gradient": "B", "weight_gradient": "W"}
"""A micro-batch's compute blocks and their labels: the forward, the whole backward, or with a zero-bubble schedule
its input-gradient pass and its weight-gradient pass."""
OPERATION_KINDS = {"F": "forward", "B": "backward", "I": "input_gradient", "W": "weight_gradient"}
"""cost.pipeline's operation letters -> event kinds."""
"""A rank's streams: its compute, what it sends (and its collectives), what it receives (full duplex)."""


@dataclass(frozen=True)
class ScheduleEvent:
    """One block of work on one pipeline rank."""

    rank: int
    """Pipeline rank (0 = first stage)."""
    lane: str
    """"compute", "communication" (sends, collectives) or "receive" (LANES)."""
    kind: str
    """"forward", "backward", "send", "recv", "grad_sync" or "optimizer"."""
    start_s: float
    """Start, seconds from the beginning of the step."""
    duration_s: float
    """Length, seconds."""
    stage: int | None = None
    """Stage.index of the stage the work belongs to (send: the sender's, recv: the receiver's);
    None for whole-rank work."""
    microbatch: int | None = None
    """Micro-batch number, None for work on the whole batch."""
    peer: int | None = None
    """For send/recv: the pipeline rank on the other end."""
    payload: str | None = None
    """For send/recv: "activation" (forward) or "gradient" (backward)."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def label(self) -> str:
        """Short name: F3 / B3 / W3 for micro-batch 3, send F3 -> 1, grad sync, ..."""
        if self.kind in COMPUTE_KINDS:
            return f"{COMPUTE_KINDS[self.kind]}{self.microbatch}"
        if self.kind in ("send", "recv"):
            direction = "to" if self.kind == "send" else "from"
            return f"{self.kind} {self.payload} {self.microbatch} {direction} rank {self.peer}"
        return self.kind.replace("_", " ")


def p2p_time_s(plan: Plan) -> float:
    """Seconds of one activation (or gradient) transfer, for plans without per-stage transfer times.

    Such plans report `pipeline_comm` as the p2p seconds of one step on a rank; a rank sends one
    activation and one gradient per micro-batch and model chunk, so one transfer is that / (2 m v).
    """
    par = plan.parallelism
    transfers = 2 * par.pipeline_parallel_num_microbatches * max(1, par.pipeline_parallel_virtual_stages)
    return max(0.0, plan.predicted.time_breakdown.get("pipeline_comm", 0.0)) / transfers


def stage_costs(plan: Plan, stages: list) -> list[StageCost]:
    """The simulation's input: each stage's forward, backward and boundary transfer per micro-batch."""
    legacy_send = 0.0 if any(st.predicted_send_s for st in stages) else p2p_time_s(plan)
    costs = []
    for st in stages:
        forward = st.predicted_forward_s or st.predicted_time_s * FORWARD_SHARE
        costs.append(StageCost(forward, st.predicted_time_s - forward, st.predicted_send_s or legacy_send,
                               weight_s=st.predicted_weight_s))
    return costs


def step_schedule(plan: Plan) -> list[ScheduleEvent]:
    """Every compute and communication block of one optimizer step, on every pipeline rank."""
    par = plan.parallelism
    stages = sorted(plan.stages, key=lambda s: s.index)
    if not stages:
        return []
    ranks = max(1, min(par.pipeline_parallel_degree, len(stages)))
    if len(stages) % ranks:  # not a whole number of chunks per rank: draw one stage per rank
        ranks = len(stages)
    m = max(1, par.pipeline_parallel_num_microbatches)
    run = simulate(par.pipeline_parallel_schedule, ranks, m, stage_costs(plan, stages))
    events: list[ScheduleEvent] = []
    for op in run.ops:
        kind = OPERATION_KINDS[op.kind]
        events.append(ScheduleEvent(op.rank, COMPUTE, kind, op.start_s, op.end_s - op.start_s,
                                    stages[op.stage].index, op.microbatch))
        if op.sent_s is None:
            continue
        target = op.neighbour
        placement = SCHEDULE_BY_NAME[par.pipeline_parallel_schedule].placement
        peer, payload = stage_rank(target, ranks, placement), "activation" if op.kind == "F" else "gradient"
        length = op.arrives_s - op.sent_s
        events.append(ScheduleEvent(op.rank, COMMUNICATION, "send", op.sent_s, length, stages[op.stage].index,
                                    op.microbatch, peer, payload))
        events.append(ScheduleEvent(peer, RECEIVE, "recv", op.sent_s, length, stages[target].index,
                                    op.microbatch, op.rank, payload))
    events += _after_backward(plan, ranks, list(run.rank_compute_end_s), list(run.rank_stream_end_s))
    return sorted(events, key=lambda e: (e.rank, LANES.index(e.lane), e.start_s))


def _after_backward(plan: Plan, ranks: int, rank_free: list[float], lane_free: list[float]) -> list[ScheduleEvent]:
    """Gradient synchronisation (data-parallel all-reduce / reduce-scatter) and the optimizer step."""
    breakdown = plan.predicted.time_breakdown
    sync = max(0.0, breakdown.get("data_parallel_comm", 0.0))
    optimizer = max(0.0, breakdown.get("optimizer", 0.0))
    events = []
    for r in range(ranks):
        ready = rank_free[r]
        if sync > 0 and plan.parallelism.data_parallel_degree > 1:
            start = max(ready, lane_free[r])
            events.append(ScheduleEvent(r, COMMUNICATION, "grad_sync", start, sync))
            ready = start + sync
        if optimizer > 0:
            events.append(ScheduleEvent(r, COMPUTE, "optimizer", max(ready, rank_free[r]), optimizer))
    return events


def makespan_s(events: list[ScheduleEvent]) -> float:
    """End of the last event: the simulated step time."""
    return max((e.end_s for e in events), default=0.0)
