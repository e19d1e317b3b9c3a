"""The predicted schedule of one optimizer step, as timed events per pipeline rank.

One function, `step_schedule`, produces the events; the HTML Gantt chart and trace.json both draw
them, so the two can never disagree. The schedule is a list-scheduling simulation: every rank runs
its micro-batch operations in the order its schedule prescribes (GPipe, 1F1B, interleaved 1F1B, and the
zero-bubble ones, whose backward runs as an input-gradient pass B and a later weight-gradient pass W),
each as soon as its inputs have arrived and the rank is free (autoplan.cost.pipeline.simulate, the
simulation the cost model prices pipelines with).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from operator import itemgetter

from autoplan.cost.pipeline import StageCost, simulate
from autoplan.layout import stage_rank
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
    transfers = 2 * par.microbatches * max(1, par.virtual_stages)
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


Block = tuple
"""A ScheduleEvent as a plain tuple, (rank, LANES index, start_s, duration_s, kind, stage, microbatch, peer, payload):
a deep pipeline's step has hundreds of thousands of blocks, most of them only summed (schedule_view)."""


def step_schedule(plan: Plan) -> list[ScheduleEvent]:
    """Every compute and communication block of one optimizer step, on every pipeline rank."""
    return [_event(b) for b in _blocks(plan)]


def _event(block: Block) -> ScheduleEvent:
    rank, lane, start, duration, kind, stage, microbatch, peer, payload = block
    return ScheduleEvent(rank, LANES[lane], kind, start, duration, stage, microbatch, peer, payload)


def _blocks(plan: Plan) -> list[Block]:
    """step_schedule's events as Blocks, sorted by rank, lane and start."""
    par = plan.parallelism
    stages = sorted(plan.stages, key=lambda s: s.index)
    if not stages:
        return []
    ranks = max(1, min(par.pp, len(stages)))
    if len(stages) % ranks:  # not a whole number of chunks per rank: draw one stage per rank
        ranks = len(stages)
    m = max(1, par.microbatches)
    run = simulate(par.schedule, ranks, m, stage_costs(plan, stages))
    placement = par.placement
    compute, communication, receive = LANES.index(COMPUTE), LANES.index(COMMUNICATION), LANES.index(RECEIVE)
    index = [st.index for st in stages]
    blocks: list[Block] = []
    for op in run.ops:
        blocks.append((op.rank, compute, op.start_s, op.end_s - op.start_s, OPERATION_KINDS[op.kind], index[op.stage],
                       op.microbatch, None, None))
        if op.sent_s is None:
            continue
        target = op.neighbour
        peer, payload = stage_rank(target, ranks, placement), "activation" if op.kind == "F" else "gradient"
        length = op.arrives_s - op.sent_s
        blocks.append((op.rank, communication, op.sent_s, length, "send", index[op.stage], op.microbatch, peer,
                       payload))
        blocks.append((peer, receive, op.sent_s, length, "recv", index[target], op.microbatch, op.rank, payload))
    blocks += _after_backward(plan, ranks, list(run.rank_compute_end_s), list(run.rank_stream_end_s))
    return sorted(blocks, key=itemgetter(0, 1, 2))


def _after_backward(plan: Plan, ranks: int, rank_free: list[float], lane_free: list[float]) -> list[Block]:
    """Gradient synchronisation (data-parallel all-reduce / reduce-scatter) and the optimizer step."""
    breakdown = plan.predicted.time_breakdown
    sync = max(0.0, breakdown.get("data_parallel_comm", 0.0))
    optimizer = max(0.0, breakdown.get("optimizer", 0.0))
    blocks: list[Block] = []
    for r in range(ranks):
        ready = rank_free[r]
        if sync > 0 and plan.parallelism.dp > 1:
            start = max(ready, lane_free[r])
            blocks.append((r, LANES.index(COMMUNICATION), start, sync, "grad_sync", None, None, None, None))
            ready = start + sync
        if optimizer > 0:
            blocks.append((r, LANES.index(COMPUTE), max(ready, rank_free[r]), optimizer, "optimizer", None, None,
                           None, None))
    return blocks


def makespan_s(events: list[ScheduleEvent]) -> float:
    """End of the last event: the simulated step time."""
    return max((e.end_s for e in events), default=0.0)


DRAWN_EVENTS = 3000
"""Blocks a schedule draws one by one (report.html's Gantt chart, trace.json). A step with more keeps whole
micro-batches drawn (the first, a steady-state window in the middle and the last: SHOWN_WINDOWS) and aggregates
the rest; issue 29: the 1T GPT's 512 micro-batches x 64 ranks were 390,000 blocks, a 63 MB report.html and a
98 MB trace.json. At about 250 bytes a block in each file, this keeps both near a megabyte."""
SHOWN_WINDOWS = 3
"""Windows of micro-batches drawn block by block when a schedule is elided: first, middle, last."""


@dataclass(frozen=True)
class ElidedSpan:
    """A run of consecutive blocks on one lane of one rank that belong to micro-batches not drawn, aggregated."""

    rank: int
    """Pipeline rank."""
    lane: str
    """LANES."""
    start_s: float
    """Start of the run's first block, seconds from the beginning of the step."""
    end_s: float
    """End of its last block."""
    count: int
    """Blocks in the run."""
    busy_s: float
    """Their summed length; the rest of the span (idle_s) the lane waited."""
    kinds: tuple[tuple[str, int], ...]
    """(kind, blocks) in order of first appearance."""
    stages: tuple[tuple[int, float], ...]
    """(Stage.index, busy seconds) in order of first appearance."""
    microbatches: tuple[int, int]
    """Lowest and highest micro-batch number among the blocks."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def idle_s(self) -> float:
        return max(0.0, self.duration_s - self.busy_s)

    @property
    def label(self) -> str:
        """"elided: 60 blocks of micro-batches 4-63"."""
        low, high = self.microbatches
        which = f"micro-batch {low}" if low == high else f"micro-batches {low}-{high}"
        return f"elided: {self.count} block{'s' if self.count != 1 else ''} of {which}"


@dataclass(frozen=True)
class ScheduleView:
    """What the report and trace.json draw of one step's schedule: every block, or (past DRAWN_EVENTS) the blocks
    of a few whole micro-batches and ElidedSpans for the rest."""

    events: tuple[ScheduleEvent, ...]
    """Blocks drawn one by one (all of them when nothing is elided)."""
    elided: tuple[ElidedSpan, ...]
    """Aggregated runs of the blocks not drawn (empty when nothing is elided)."""
    microbatches: int
    """Micro-batches in the step."""
    drawn_microbatches: tuple[int, ...]
    """Micro-batches whose blocks are drawn, ascending."""
    makespan_s: float
    """The simulated step time (the end of the last block, drawn or not)."""

    @property
    def ranks(self) -> int:
        return 1 + max((e.rank for e in (*self.events, *self.elided)), default=-1)

    def lane_busy_s(self) -> dict[tuple[int, str], float]:
        """(rank, lane) -> seconds of work on it, drawn and elided blocks together."""
        busy: dict[tuple[int, str], float] = defaultdict(float)
        for e in self.events:
            busy[e.rank, e.lane] += e.duration_s
        for span in self.elided:
            busy[span.rank, span.lane] += span.busy_s
        return dict(busy)

    def rank_stages(self) -> dict[int, list[int]]:
        """Pipeline rank -> the stages whose compute it runs, ascending."""
        stages: dict[int, set[int]] = defaultdict(set)
        for e in self.events:
            if e.lane == COMPUTE and e.stage is not None:
                stages[e.rank].add(e.stage)
        for span in self.elided:
            if span.lane == COMPUTE:
                stages[span.rank].update(s for s, _ in span.stages)
        return {r: sorted(s) for r, s in stages.items()}


def schedule_view(plan: Plan, budget: int = DRAWN_EVENTS) -> ScheduleView:
    """step_schedule(plan), elided to about `budget` drawn blocks when it has more."""
    if _last_view and _last_view[0] is plan and _last_view[1] == budget:
        return _last_view[2]
    blocks = _blocks(plan)
    m = max(1, plan.parallelism.microbatches)
    shown = drawn_microbatches(m, sum(1 for b in blocks if b[6] is not None) / m, budget)
    drawn, elided = _elide(blocks, shown)
    end = max((b[2] + b[3] for b in blocks), default=0.0)
    view = ScheduleView(tuple(drawn), tuple(elided), m, tuple(sorted(shown)), end)
    _last_view[:] = [plan, budget, view]
    return view


_last_view: list = []
"""(plan, budget, view) of the last schedule_view call: report.html and trace.json of one plan draw the same view,
and a deep pipeline's simulation takes seconds."""


def drawn_microbatches(microbatches: int, blocks_per_microbatch: float, budget: int) -> frozenset[int]:
    """Every micro-batch when their blocks fit `budget`; else SHOWN_WINDOWS windows of equal width (the first, the
    middle and the last micro-batches), as wide as the budget allows and at least one micro-batch each."""
    m = microbatches
    if m * blocks_per_microbatch <= budget:
        return frozenset(range(m))
    width = max(1, int(budget // (SHOWN_WINDOWS * max(blocks_per_microbatch, 1.0))))
    middle = (m - width) // 2
    return frozenset(range(width)) | frozenset(range(middle, middle + width)) | frozenset(range(m - width, m))


def _elide(blocks: list[Block], shown: frozenset[int]) -> tuple[list[ScheduleEvent], list[ElidedSpan]]:
    """Split blocks (sorted by rank, lane and start) into the events drawn (whole-batch work and the micro-batches in
    `shown`) and one ElidedSpan per run of the others on a lane."""
    drawn: list[ScheduleEvent] = []
    spans: list[ElidedSpan] = []
    run: list[Block] = []
    lane = None
    for b in blocks:
        if run and lane != (b[0], b[1]):
            spans.append(_aggregate(run))
            run = []
        lane = b[0], b[1]
        if b[6] is None or b[6] in shown:
            if run:
                spans.append(_aggregate(run))
                run = []
            drawn.append(_event(b))
        else:
            run.append(b)
    if run:
        spans.append(_aggregate(run))
    return drawn, spans


def _aggregate(run: list[Block]) -> ElidedSpan:
    kinds = Counter(b[4] for b in run)
    stages: dict[int, float] = defaultdict(float)
    for b in run:
        if b[5] is not None:
            stages[b[5]] += b[3]
    numbers = [b[6] for b in run]
    return ElidedSpan(run[0][0], LANES[run[0][1]], run[0][2], max(b[2] + b[3] for b in run), len(run),
                      sum(b[3] for b in run), tuple(kinds.items()), tuple(stages.items()), (min(numbers), max(numbers)))


def number_ranges(numbers: tuple[int, ...]) -> str:
    """(0, 1, 255, 256, 511) -> "0-1, 255-256, 511"."""
    parts: list[list[int]] = []
    for n in numbers:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
