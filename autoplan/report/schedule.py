"""The predicted schedule of one optimizer step, as timed events per pipeline rank.

One function, `step_schedule`, produces the events; the HTML Gantt chart and trace.json both draw
them, so the two can never disagree. The schedule is a list-scheduling simulation: every rank runs
its micro-batch operations in the order its schedule prescribes (GPipe, 1F1B, interleaved 1F1B),
each as soon as its inputs have arrived and the rank is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.plan import Plan

FORWARD_SHARE = 1 / 3
"""Share of a stage's forward+backward time spent in forward: backward costs about twice the
forward (Narayanan et al., SC21; shared/reference/formulas.md)."""

COMPUTE = "compute"
COMMUNICATION = "communication"
LANES = (COMPUTE, COMMUNICATION)


@dataclass(frozen=True)
class ScheduleEvent:
    """One block of work on one pipeline rank."""

    rank: int
    """Pipeline rank (0 = first stage)."""
    lane: str
    """"compute" or "communication" (a rank's two streams)."""
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
        """Short name: F3 / B3 for micro-batch 3, send F3 -> 1, grad sync, ..."""
        if self.kind in ("forward", "backward"):
            return f"{self.kind[0].upper()}{self.microbatch}"
        if self.kind in ("send", "recv"):
            direction = "to" if self.kind == "send" else "from"
            return f"{self.kind} {self.payload} {self.microbatch} {direction} rank {self.peer}"
        return self.kind.replace("_", " ")


def rank_order(schedule: str, num_ranks: int, num_microbatches: int, rank: int,
               chunks: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, chunk, microbatch) operations of one rank in the order its schedule runs them.

    chunk is the rank's local model chunk (0 unless interleaved): global stage = chunk * num_ranks + rank.
    """
    m, p = num_microbatches, num_ranks
    if schedule == "gpipe":
        forwards = [("F", c, i) for c in range(chunks) for i in range(m)]
        backwards = [("B", c, i) for c in reversed(range(chunks)) for i in range(m)]
        return forwards + backwards
    if schedule == "interleaved" and chunks > 1:
        return _interleaved_order(p, m, rank, chunks)
    # 1F1B (PipeDream-Flush): rank r runs p-1-r warm-up forwards, then alternates, then drains.
    warmup = min(p - 1 - rank, m)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    return order + [("B", 0, i) for i in range(m - warmup, m)]


def _interleaved_order(p: int, m: int, rank: int, chunks: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., SC21, Fig. 4), as torch's
    ScheduleInterleaved1F1B runs it: micro-batches go through the chunks in groups of p."""
    total = m * chunks

    def op(kind: str, k: int) -> tuple[str, int, int]:
        group, within = divmod(k, p * chunks)
        chunk = within // p
        microbatch = group * p + within % p
        return (kind, chunk if kind == "F" else chunks - 1 - chunk, microbatch)

    if m % p:
        # Megatron's grouping needs m to be a multiple of p; otherwise run chunk by chunk (deadlock-free).
        return rank_order("gpipe", p, m, rank, chunks)
    warmup = min((p - rank - 1) * 2 + (chunks - 1) * p, total)
    order = [op("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [op("F", warmup + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def p2p_time_s(plan: Plan) -> float:
    """Seconds of one activation (or gradient) transfer between neighbouring stages.

    The cost model reports `pipeline_comm` as the p2p seconds of one step on a rank; a rank sends one
    activation and one gradient per micro-batch and model chunk, so one transfer is that / (2 m v).
    """
    par = plan.parallelism
    transfers = 2 * par.pipeline_parallel_num_microbatches * max(1, par.pipeline_parallel_virtual_stages)
    return max(0.0, plan.predicted.time_breakdown.get("pipeline_comm", 0.0)) / transfers


def step_schedule(plan: Plan) -> list[ScheduleEvent]:
    """Every compute and communication block of one optimizer step, on every pipeline rank."""
    par = plan.parallelism
    stages = sorted(plan.stages, key=lambda s: s.index)
    if not stages:
        return []
    ranks = max(1, min(par.pipeline_parallel_degree, len(stages)))
    if len(stages) % ranks:  # not a whole number of chunks per rank: draw one stage per rank
        ranks = len(stages)
    chunks = len(stages) // ranks
    m = max(1, par.pipeline_parallel_num_microbatches)
    schedule = par.pipeline_parallel_schedule
    orders = [rank_order(schedule, ranks, m, r, chunks) for r in range(ranks)]

    def stage_of(rank: int, chunk: int) -> int:
        return chunk * ranks + rank

    num_stages = ranks * chunks
    p2p = p2p_time_s(plan) if ranks > 1 else 0.0
    done: dict[tuple[str, int, int], float] = {}  # (kind, global stage, microbatch) -> time its output arrives
    rank_free = [0.0] * ranks
    lane_free = [0.0] * ranks
    position = [0] * ranks
    events: list[ScheduleEvent] = []

    def input_ready(kind: str, stage: int, mb: int) -> float | None:
        """When the inputs of (kind, stage, mb) are on its rank; None if not produced yet."""
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", stage - 1, mb))
        if stage == num_stages - 1:
            return done.get(("F", stage, mb))  # the loss is computed right after the last forward
        return done.get(("B", stage + 1, mb))

    while any(position[r] < len(orders[r]) for r in range(ranks)):
        ready = []
        for r in range(ranks):
            if position[r] < len(orders[r]):
                kind, chunk, mb = orders[r][position[r]]
                arrival = input_ready(kind, stage_of(r, chunk), mb)
                if arrival is not None:
                    ready.append((max(arrival, rank_free[r]), r))
        assert ready, f"{schedule} schedule deadlocked at positions {position}"
        start, r = min(ready)
        kind, chunk, mb = orders[r][position[r]]
        position[r] += 1
        stage = stage_of(r, chunk)
        total = stages[stage].predicted_time_s
        duration = total * FORWARD_SHARE if kind == "F" else total * (1 - FORWARD_SHARE)
        end = start + duration
        rank_free[r] = end
        events.append(ScheduleEvent(r, COMPUTE, "forward" if kind == "F" else "backward", start, duration,
                                    stages[stage].index, mb))
        target = stage + 1 if kind == "F" else stage - 1
        if 0 <= target < num_stages:
            peer = target % ranks
            if peer == r or p2p == 0.0:
                done[(kind, stage, mb)] = end
                continue
            # One transfer occupies the communication stream of both ends (NCCL/gloo p2p are paired).
            sent = max(end, lane_free[r], lane_free[peer])
            lane_free[r] = lane_free[peer] = sent + p2p
            payload = "activation" if kind == "F" else "gradient"
            events.append(ScheduleEvent(r, COMMUNICATION, "send", sent, p2p, stages[stage].index, mb, peer, payload))
            events.append(ScheduleEvent(peer, COMMUNICATION, "recv", sent, p2p, stages[target].index, mb, r,
                                        payload))
            done[(kind, stage, mb)] = sent + p2p
        else:
            done[(kind, stage, mb)] = end

    events += _after_backward(plan, ranks, rank_free, lane_free)
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
