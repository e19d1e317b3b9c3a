"""Pipeline schedules: micro-batches in flight (memory) and the bubble (time).

p pipeline ranks, m micro-batches, v stages per rank (stage s runs on rank autoplan.layout.stage_rank(s, p, placement)).
- GPipe runs every forward before any backward: each stage keeps all m micro-batches.
- 1F1B (torch Schedule1F1B) warms up with p - 1 - r forwards on rank r, so it keeps p - r.
- Interleaved 1F1B (torch ScheduleInterleaved1F1B, schedules._get_warmup_ops) warms up with
  (v - 1) p + 2 (p - 1 - r) forwards, issued in rounds of p micro-batches per local stage; the
  micro-batches in flight of each local stage are counted from that order (rank 0 holds about
  (1 + 1/v) x the 1F1B amount, Narayanan et al. SC21 section 2.2).
Bubble (Narayanan et al. SC21; shared/reference/formulas.md): (p - 1) slots of the slowest rank for
GPipe and 1F1B, (p - 1) / v for interleaved, where a slot is one micro-batch through all of a rank's
stages. That closed form assumes balanced stages, free transfers and a backward of twice the forward;
`simulate` drops all three: every rank runs its operations in its schedule's order, each as soon as
its input has arrived (a transfer after the producing operation) and the rank is free. Step times
are priced with the simulation (`swept_makespan_s` runs the same orders vectorized for pipelines of 32-64
stages), the search's lower bounds with the closed form (never above it).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autoplan.cost.pipeline_recv import receive_posted_after
from autoplan.layout import SCHEDULE_BY_NAME, placement_of, rank_stages, stage_rank

SCHEDULES_SUPPORTED = tuple(SCHEDULE_BY_NAME)
"""Every schedule of the plan vocabulary (autoplan.layout.SCHEDULE_TABLE) is priced."""


def interleaved_warmup(rank: int, pp: int, virtual_stages: int, microbatches: int) -> int:
    """Forward micro-batch-stages a rank runs before its first backward (torch _get_warmup_ops)."""
    rounds = max(1, microbatches // pp)
    per_round = microbatches // rounds
    return min((virtual_stages - 1) * per_round + 2 * (pp - 1 - rank), microbatches * virtual_stages)


@lru_cache(maxsize=None)  # every stage of every priced layout asks (tens of thousands of keys on the largest searches)
def microbatches_in_flight(schedule: str, pp: int, microbatches: int, stage_index: int,
                           virtual_stages: int = 1) -> int:
    """Micro-batches whose activations the rank running `stage_index` keeps for that stage at its peak, by the
    schedule's in_flight rule (autoplan.layout.Schedule.in_flight)."""
    if pp == 1:
        return 1  # gradient accumulation: each micro-batch's backward runs before the next forward
    if schedule not in SCHEDULE_BY_NAME:
        raise ValueError(f"schedule {schedule!r} is not priced (supported: {SCHEDULES_SUPPORTED})")
    facts = SCHEDULE_BY_NAME[schedule]
    if facts.in_flight == "all":
        return microbatches
    if facts.in_flight == "pp_minus_stage":
        return min(microbatches, pp - stage_index)
    rank = stage_rank(stage_index, pp, facts.placement)
    local = rank_stages(rank, pp, virtual_stages, facts.placement).index(stage_index)
    if facts.in_flight == "rounds":
        rounds = max(1, microbatches // pp)
        per_round = microbatches // rounds
        issued = interleaved_warmup(rank, pp, virtual_stages, microbatches) + 1
        cycles, rest = divmod(issued, per_round * virtual_stages)  # forwards go in rounds of per_round per local stage
        return min(microbatches, cycles * per_round + min(per_round, max(0, rest - local * per_round)))
    if facts.in_flight == "simulated":
        return split_backward_in_flight(schedule, pp, microbatches, rank, virtual_stages)[local]
    raise ValueError(f"schedule {schedule!r}: in_flight rule {facts.in_flight!r} is not priced")


@lru_cache(maxsize=None)  # one simulated schedule per rank, read by each of its stages (microbatches_in_flight)
def split_backward_in_flight(schedule: str, pp: int, microbatches: int, rank: int,
                             chunks: int) -> tuple[int, ...]:
    """Micro-batches each of the rank's stages (chunk order) holds activations for when the rank holds the most
    (summed over its stages): from a micro-batch's forward to its weight-gradient pass (or whole backward), which
    a zero-bubble schedule runs later than 1F1B would, keeping the activations the matmuls' weight gradients read."""
    alive, peak, best = [0] * chunks, [0] * chunks, -1
    for kind, chunk, _ in split_backward_order(schedule, pp, microbatches, rank, chunks):
        alive[chunk] += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        if sum(alive) > best:
            best, peak = sum(alive), list(alive)
    return tuple(peak)


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


def pipeline_time(slot_s: float, pp: int, microbatches: int, virtual_stages: int = 1) -> PipelineTime:
    """(m + (p - 1) / v) x slowest slot."""
    return PipelineTime(busy_s=microbatches * slot_s, bubble_s=(pp - 1) / virtual_stages * slot_s)


def rank_order(schedule: str, pp: int, microbatches: int, rank: int,
               chunks: int = 1) -> list[tuple[str, int, int]]:
    """The ("F" | "B" | "I" | "W", chunk, microbatch) operations of one rank in the order its schedule runs them
    (ORDERS; 1F1B for a name outside the table).

    chunk is the rank's local model chunk (0 unless it holds several stages: autoplan.layout.rank_stages).
    """
    return ORDERS.get(schedule, _one_f_one_b_order)(pp, microbatches, rank, chunks)


def _gpipe_order(p: int, m: int, rank: int, chunks: int) -> list[tuple[str, int, int]]:
    """GPipe: every forward, then every backward."""
    forwards = [("F", c, i) for c in range(chunks) for i in range(m)]
    backwards = [("B", c, i) for c in reversed(range(chunks)) for i in range(m)]
    return forwards + backwards


def _one_f_one_b_order(p: int, m: int, rank: int, chunks: int = 1) -> list[tuple[str, int, int]]:
    """1F1B (PipeDream-Flush): rank r runs p-1-r warm-up forwards, then alternates, then drains (chunk 0)."""
    warmup = min(p - 1 - rank, m)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    return order + [("B", 0, i) for i in range(m - warmup, m)]


def _interleaved_or_1f1b_order(p: int, m: int, rank: int, chunks: int) -> list[tuple[str, int, int]]:
    """ScheduleInterleaved1F1B: with one stage per rank it runs as 1F1B."""
    return _interleaved_order(p, m, rank, chunks) if chunks > 1 else _one_f_one_b_order(p, m, rank)


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
        return _gpipe_order(p, m, rank, chunks)
    warmup = min((p - rank - 1) * 2 + (chunks - 1) * p, total)
    order = [op("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [op("F", warmup + i), op("B", i)]
    return order + [op("B", k) for k in range(total - warmup, total)]


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's work for one micro-batch, seconds."""

    forward_s: float
    """Forward on the stage's rank (compute, its collectives and host time)."""
    backward_s: float
    """Backward, recomputation included."""
    send_s: float = 0.0
    """One transfer across the boundary after this stage: its activation forward, and the gradient of
    that activation back (the same bytes). 0 for the last stage."""
    weight_s: float = 0.0
    """Of backward_s, the weight gradients' matmuls: the pass (W) a zero-bubble schedule runs apart from the
    input-gradient pass (I, backward_s - weight_s)."""


@dataclass(frozen=True)
class SimulatedOp:
    """One forward or backward of one micro-batch on one stage, and the transfer of its output."""

    kind: str
    """"F", "B" (a whole backward), or with a zero-bubble schedule "I" (input gradients) and "W" (weight
    gradients, sent nowhere)."""
    rank: int
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    sent_s: float | None = None
    """When the output's transfer to the neighbouring stage's rank started; None when nothing is sent
    (first stage's backward, last stage's forward, or the neighbour on the same rank)."""
    arrives_s: float = 0.0
    """When the output is usable by the neighbouring stage."""

    @property
    def neighbour(self) -> int:
        """The stage its output feeds: the next one after a forward, the previous after a backward (the
        stage itself after a weight-gradient pass: it sends nothing)."""
        return self.stage + 1 if self.kind == "F" else self.stage if self.kind == "W" else self.stage - 1

    @property
    def boundary(self) -> int:
        """Index of the stage whose send_s prices that output's transfer (the earlier of the two)."""
        return min(self.stage, self.neighbour)


@dataclass(frozen=True)
class SimulatedPipeline:
    ops: tuple[SimulatedOp, ...]
    """Every operation, in the order each rank runs them."""
    rank_compute_end_s: tuple[float, ...]
    """When each rank's last operation ends."""
    rank_stream_end_s: tuple[float, ...]
    """When the last transfer into or out of each rank ends."""

    @property
    def makespan_s(self) -> float:
        return max(max(self.rank_compute_end_s), max(self.rank_stream_end_s))


@lru_cache(maxsize=256)
def _orders_and_receives(schedule: str, p: int, m: int, chunks: int):
    """Every rank's operation order and where it posts its receives (a search simulates the same
    schedule shapes over and over with different stage costs)."""
    orders = tuple(tuple(rank_order(schedule, p, m, r, chunks)) for r in range(p))
    if schedule in SCHEDULE_BY_NAME and SCHEDULE_BY_NAME[schedule].split_backward:
        return orders, {}  # receives taken as posted from the start (cost/pipeline_recv.py models the others)
    return orders, receive_posted_after(orders, m, chunks)


def simulate(schedule: str, pp: int, microbatches: int, stages: Sequence[StageCost]) -> SimulatedPipeline:
    """Run the schedule's operation order on every rank (stage s on rank layout.stage_rank(s, p, placement):
    s % p, or the V of zbv and dualpipev).

    An operation starts when its rank is free and its input is there: a forward needs the previous
    stage's forward of that micro-batch, a backward the next stage's backward (the last stage's, its
    own forward), a weight-gradient pass its input-gradient pass. A transfer between ranks takes the boundary's `send_s` and holds the sender's send
    stream and the receiver's receive stream (links are full duplex: a rank sends and receives at
    once), beside their compute; it starts no earlier than the receiver posts its receive, after the
    operation torch's schedule posts it behind (cost/pipeline_recv.py: transfers are rendezvous).
    Events (an operation starts, an output is ready to send) are taken from a heap in time order, so
    streams are claimed first come, first served.
    """
    p = max(1, pp)
    if len(stages) % p:
        raise ValueError(f"{len(stages)} stages do not split evenly over {p} pipeline ranks")
    chunks, m, last = len(stages) // p, microbatches, len(stages) - 1
    orders, posted = _orders_and_receives(schedule, p, m, chunks)
    placement = placement_of(schedule)
    local = [rank_stages(r, p, chunks, placement) for r in range(p)]
    unposted: dict[tuple[int, int], list[tuple[SimulatedOp, int]]] = {}  # (rank, op index) -> transfers after it
    arrived: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], int] = {}  # an output not produced yet -> the rank that needs it
    compute_free, send_free, receive_free, position = [0.0] * p, [0.0] * p, [0.0] * p, [0] * p
    ops: list[list[SimulatedOp]] = [[] for _ in range(p)]
    runnable: list[tuple] = []  # (time, sequence, rank, None to start its next operation | a transfer)
    sequence = itertools.count()

    def push(when: float, r: int, transfer: tuple[SimulatedOp, int] | None = None) -> None:
        heapq.heappush(runnable, (when, next(sequence), r, transfer))

    def offer(r: int) -> None:
        """Queue rank r's next operation if its input is there, else wait for that input."""
        if position[r] == len(orders[r]):
            return
        kind, chunk, mb = orders[r][position[r]]
        stage = local[r][chunk]
        if kind == "F":
            needed = None if stage == 0 else ("F", stage - 1, mb)
        elif kind == "W":
            needed = ("I", stage, mb)
        else:
            needed = ("F", stage, mb) if stage == last else ("B", stage + 1, mb)  # an I delivers as a B
        ready = 0.0 if needed is None else arrived.get(needed)
        if ready is None:
            waiting[needed] = r
        else:
            push(max(ready, compute_free[r]), r)

    def deliver(produced: tuple[str, int, int], when: float) -> None:
        arrived[produced] = when
        if produced in waiting:
            offer(waiting.pop(produced))

    for r in range(p):
        offer(r)
    while runnable:
        now, _, r, transfer = heapq.heappop(runnable)
        if transfer is not None:  # an output ready at `now` claims the sender's and receiver's streams
            op, index = transfer
            peer = stage_rank(op.neighbour, p, placement)
            after = posted.get((op.kind, op.stage, op.microbatch), -1)
            if after >= len(ops[peer]):  # the receiver has not reached its receive yet
                unposted.setdefault((peer, after), []).append(transfer)
                continue
            if after >= 0 and ops[peer][after].end_s > now:
                push(ops[peer][after].end_s, r, transfer)
                continue
            sent = max(now, send_free[r], receive_free[peer])
            arrives = send_free[r] = receive_free[peer] = sent + stages[op.boundary].send_s
            # built field by field: dataclasses.replace was a fifth of a 64-rank, 512-micro-batch simulation
            ops[r][index] = SimulatedOp(op.kind, op.rank, op.stage, op.microbatch, op.start_s, op.end_s, sent, arrives)
            deliver(("B" if op.kind == "I" else op.kind, op.stage, op.microbatch), arrives)
            continue
        kind, chunk, mb = orders[r][position[r]]
        stage = local[r][chunk]
        cost = stages[stage]
        duration = {"F": cost.forward_s, "B": cost.backward_s, "I": cost.backward_s - cost.weight_s,
                    "W": cost.weight_s}[kind]
        end = compute_free[r] = now + duration
        op = SimulatedOp(kind, r, stage, mb, now, end, None, end)
        ops[r].append(op)
        for waiting_transfer in unposted.pop((r, len(ops[r]) - 1), []):  # receives posted once this op ends
            push(end, waiting_transfer[0].rank, waiting_transfer)
        position[r] += 1
        offer(r)
        if kind == "I":
            deliver(("I", stage, mb), end)  # its weight-gradient pass, on this rank
        if 0 <= op.neighbour <= last and stage_rank(op.neighbour, p, placement) != r and stages[op.boundary].send_s > 0:
            push(end, r, (op, len(ops[r]) - 1))
        else:
            deliver(("B" if kind == "I" else kind, stage, mb), end)
    if any(position[r] < len(orders[r]) for r in range(p)):
        raise ValueError(f"{schedule} schedule deadlocked at positions {position}")
    streams = tuple(max(a, b) for a, b in zip(send_free, receive_free))
    return SimulatedPipeline(tuple(op for rank_ops in ops for op in rank_ops), tuple(compute_free), streams)


SIMULATED_OPERATIONS_MAX = 2048
"""Largest pipeline `simulated_step_s` runs through `simulate` (forwards + backwards over all stages, ~15-50 us
each): a search prices hundreds of layouts, so longer ones are extrapolated from shorter simulations or, deeper
still, priced by `swept_makespan_s` (the same operation orders, vectorized)."""


def simulated_step_s(schedule: str, pp: int, microbatches: int, stages: Sequence[StageCost]) -> float:
    """Makespan of the simulated pipeline.

    Within SIMULATED_OPERATIONS_MAX operations, `simulate`. Longer runs: past the warm-up every extra round of p
    micro-batches adds the same time (the steady state repeats), so they are extrapolated linearly from runs of m1
    and m1 + p micro-batches with m1 = m (mod p), which keeps torch's grouping of interleaved rounds: simulated, or
    for pipelines too deep for that (32-64 stages) every operation of their schedule's order run in
    `swept_makespan_s`, as are deep runs of at most six rounds."""
    m, p = microbatches, max(1, pp)
    per_microbatch = 2 * len(stages)
    if m * per_microbatch <= SIMULATED_OPERATIONS_MAX:
        return simulate(schedule, p, m, stages).makespan_s
    # six rounds (the warm-up of a deep interleaved schedule settles within four, DualPipeV's within five), the
    # residue of m
    m2 = max(6 * p, 32)
    m2 -= (m2 - m) % p
    m1 = m2 - p
    if m2 >= m:
        return swept_makespan_s(schedule, p, m, stages)
    if m2 * per_microbatch <= SIMULATED_OPERATIONS_MAX:
        t1, t2 = (simulate(schedule, p, k, stages).makespan_s for k in (m1, m2))
    else:
        t1, t2 = (swept_makespan_s(schedule, p, k, stages) for k in (m1, m2))
    return t2 + (m - m2) / p * (t2 - t1)


@dataclass(frozen=True)
class _Dependencies:
    """A schedule's operations (every rank's order, concatenated) as arrays, sorted by level (an operation's level
    is one more than the highest of the operations it waits for, so each level's operations can be timed
    together once the levels before it are): what `swept_makespan_s` needs."""

    level_bounds: tuple[int, ...]
    """[level_bounds[k], level_bounds[k + 1]) are level k's operations in the arrays below."""
    index: "np.ndarray"
    """The operation's position in the concatenated rank orders."""
    stage: "np.ndarray"
    kind: "np.ndarray"
    """Index into (F, B, I, W)."""
    previous: "np.ndarray"
    """The rank's operation before it (len(index) when none)."""
    producer: "np.ndarray"
    """The operation on another rank whose output it needs (len(index) when none: a first-stage forward, or an
    input produced on the same rank, which the rank's own order runs before it)."""
    boundary: "np.ndarray"
    """The stage whose send_s prices that transfer (-1 when none)."""
    posted_after: "np.ndarray"
    """The operation of its rank after which its receive of that input is posted (len(index) when from the start:
    cost/pipeline_recv.py)."""


_KINDS = "FBIW"


@lru_cache(maxsize=16)
def _dependencies(schedule: str, p: int, m: int, chunks: int) -> _Dependencies:
    """The arrays of a schedule shape, built once (a search prices the same shapes over and over with different
    stage costs); the operation orders they come from are not kept (10^5 operations for a deep pipeline)."""
    orders, posted = _orders_and_receives.__wrapped__(schedule, p, m, chunks)
    placement = placement_of(schedule)
    last = p * chunks - 1
    offsets = list(itertools.accumulate((len(o) for o in orders), initial=0))
    total = offsets[-1]
    made: dict[tuple[str, int, int], tuple[int, int]] = {}  # output -> (index, rank)
    stage, kind = [0] * total, [0] * total
    for r, order in enumerate(orders):
        local = rank_stages(r, p, chunks, placement)
        for i, (k, chunk, mb) in enumerate(order):
            g = offsets[r] + i
            stage[g], kind[g] = local[chunk], _KINDS.index(k)
            if k != "W":
                made["B" if k == "I" else k, local[chunk], mb] = (g, r)
    previous = [g - 1 if g > offsets[r] else total for r in range(p) for g in range(offsets[r], offsets[r + 1])]
    producer, boundary, after = [total] * total, [-1] * total, [total] * total
    for r, order in enumerate(orders):
        for i, (k, chunk, mb) in enumerate(order):
            g, s = offsets[r] + i, stage[offsets[r] + i]
            if k == "W" or (k == "F" and s == 0):
                continue
            needed = ("F", s - 1, mb) if k == "F" else ("F", s, mb) if s == last else ("B", s + 1, mb)
            if needed not in made:
                raise ValueError(f"{schedule} schedule deadlocked: no rank produces {needed} (pp={p}, "
                                 f"microbatches={m}, stages per rank={chunks})")
            source, source_rank = made[needed]
            if source_rank == r:
                continue
            producer[g], boundary[g] = source, min(s, needed[1])
            post = posted.get((_KINDS[kind[source]], needed[1], mb), -1)
            if post >= 0:
                after[g] = offsets[r] + post
    level = _levels(offsets, producer, after, schedule)
    order = np.argsort(np.array(level), kind="stable")
    bounds = np.searchsorted(np.array(level)[order], np.arange(max(level) + 2)) if total else np.zeros(1, int)

    def sort(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int32)[order]

    return _Dependencies(tuple(int(x) for x in bounds), order.astype(np.int32), sort(stage), sort(kind),
                         sort(previous), sort(producer), sort(boundary), sort(after))


def _levels(offsets: list[int], producer: list[int], after: list[int], schedule: str) -> list[int]:
    """Each operation's level: 1 + the highest level of the rank's previous operation, its input's producer and
    the operation its receive is posted after (0 for none). A rank advances while what it waits for has a level,
    else waits for that operation; ranks left waiting when none can advance are deadlocked."""
    total = offsets[-1]
    level = [-1] * (total + 1)  # [total]: "none"
    position = list(offsets[:-1])
    waiting: dict[int, list[int]] = {}  # an operation without a level -> the ranks waiting for it
    ready = list(range(len(position)))
    while ready:
        r = ready.pop()
        g, end = position[r], offsets[r + 1]
        while g < end:
            blocker = next((x for x in (producer[g], after[g]) if x != total and level[x] < 0), None)
            if blocker is not None:
                waiting.setdefault(blocker, []).append(r)
                break
            level[g] = 1 + max(level[g - 1] if g > offsets[r] else -1, level[producer[g]], level[after[g]])
            ready += waiting.pop(g, ())
            g += 1
        position[r] = g
    if any(g < end for g, end in zip(position, offsets[1:])):
        raise ValueError(f"{schedule} schedule deadlocked at positions {[g - o for g, o in zip(position, offsets)]}")
    return level[:total]


def swept_makespan_s(schedule: str, pp: int, microbatches: int, stages: Sequence[StageCost]) -> float:
    """Makespan of every rank running its schedule's operation order (the order `simulate` runs), vectorized.

    Each operation ends at max(the rank's previous operation's end, its input's arrival) + its duration; the
    operations are timed level by level (_Dependencies), all of a level at once. An input from another rank
    arrives its boundary's send_s after the later of its production and the receive's posting, as in `simulate`,
    but transfers do not queue for the send and receive streams (`simulate` serves them first come, first served:
    identical without transfers, tests/test_zero_bubble_cost.py bounds the difference with them)."""
    p = max(1, pp)
    if len(stages) % p:
        raise ValueError(f"{len(stages)} stages do not split evenly over {p} pipeline ranks")
    deps = _dependencies(schedule, p, microbatches, len(stages) // p)
    table = np.array([[c.forward_s, c.backward_s, c.backward_s - c.weight_s, c.weight_s] for c in stages])
    send = np.array([c.send_s for c in stages] + [0.0])  # [-1]: no transfer
    duration = table[deps.stage, deps.kind]
    latency = send[deps.boundary]
    none = len(duration)
    # a transfer of zero time is no transfer: the input is there when produced, whenever the receive is posted
    after = np.where(latency > 0, deps.posted_after, none)
    end = np.zeros(none + 1)  # [none]: 0
    bounds = deps.level_bounds
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        ready = np.maximum(end[deps.producer[lo:hi]], end[after[lo:hi]]) + latency[lo:hi]
        end[deps.index[lo:hi]] = np.maximum(end[deps.previous[lo:hi]], ready) + duration[lo:hi]
    return float(end.max())


def split_backward_order(schedule: str, pp: int, microbatches: int, rank: int,
                         chunks: int) -> list[tuple[str, int, int]]:
    """The ("F" | "B" | "I" | "W", chunk, microbatch) operations of one rank of a zero-bubble schedule, in
    torch's order (the _calculate_single_rank_operations of its class, ported without torch: the core never
    imports it; tests/test_zero_bubble_cost.py checks them against torch's). "B" is a whole backward, "I" its
    input-gradient pass, "W" its weight-gradient pass. chunk indexes the rank's stages in increasing order
    (autoplan.layout.rank_stages); DualPipeV's overlapped forward + backward pairs run one after the other."""
    if schedule in SCHEDULE_BY_NAME and SCHEDULE_BY_NAME[schedule].split_backward:
        return ORDERS[schedule](pp, microbatches, rank, chunks)
    raise ValueError(f"schedule {schedule!r} does not split its backward")


def _zero_bubble_interleaved_order(p: int, m: int, rank: int, chunks: int) -> list[tuple[str, int, int]]:
    """ScheduleInterleavedZeroBubble (ZB-1P): torch's _get_1f1b_rank_ops with enable_zero_bubble, warm-up of
    _get_warmup_ops with multiply_factor 1; the W of the k-th backward follows the backward `rank` places later."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((chunks - 1) * per_round + (p - 1 - rank), m * chunks)
    steady = m * chunks - warmup
    forward_mb, backward_mb, weight_mb = [0] * chunks, [0] * chunks, [0] * chunks
    backward_steps: list[int] = []
    order: list[tuple[str, int, int]] = []

    def forward_chunk(step: int) -> int:
        return (step // per_round) % chunks

    def backward_chunk(step: int) -> int:
        return chunks - 1 - ((step - warmup) // per_round) % chunks

    def take(counts: list[int], chunk: int) -> int:
        counts[chunk] += 1
        return counts[chunk] - 1

    def weight() -> None:
        chunk = backward_chunk(backward_steps[len(order_w)])
        order_w.append(chunk)
        order.append(("W", chunk, take(weight_mb, chunk)))

    order_w: list[int] = []
    for step in range(warmup + steady + warmup):
        if step < warmup:
            chunk = forward_chunk(step)
            order.append(("F", chunk, take(forward_mb, chunk)))
            continue
        if step < warmup + steady:
            chunk = forward_chunk(step)
            order.append(("F", chunk, take(forward_mb, chunk)))
        chunk = backward_chunk(step)
        order.append(("I", chunk, take(backward_mb, chunk)))
        backward_steps.append(step)
        if step - warmup >= rank:
            weight()
    while len(order_w) < len(backward_steps):
        weight()
    return order


def _zbv_order(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """ScheduleZBVZeroBubble (ZB-V, Qi et al. section 6): chunk 0 is stage rank, chunk 1 stage 2p - 1 - rank;
    torch plans max(2p - 1, m) micro-batches and drops those past m."""
    n = max(2 * p - 1, m)
    counts = {(kind, chunk): 0 for kind in "FIW" for chunk in (0, 1)}
    order: list[tuple[str, int, int]] = []

    def add(kind: str, chunk: int, index: int | None = None) -> None:
        key = (kind, chunk)
        mb = counts[key] if index is None else index
        order.append((kind, chunk, mb))
        if index is None:
            counts[key] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1)
        add("F", 0)
    for _ in range(p - rank):
        add("F", 1)
        add("I", 1)
        add("W", 1)
    while counts["F", 1] < counts["F", 0] or counts["F", 0] < n:
        if counts["F", 0] < n:
            add("F", 0)
        add("I", 0)
        add("W", 0)
        add("F", 1)
        add("I", 1)
        add("W", 1)
    for _ in range(rank):
        add("I", 0)
        add("I", 1)
    for _ in range(p - rank):
        add("I", 0)
        add("W", 0)
    while counts["W", 1] < counts["I", 1]:
        add("W", 1)
    while counts["W", 0] < counts["I", 0]:
        add("W", 0)
    return [op for op in order if op[2] < m]


def _dualpipev_order(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """ScheduleDualPipeV (DeepSeek's DualPipe cut in a V): chunk 0 is stage rank, chunk 1 stage 2p - 1 - rank; a
    whole backward ("B") takes the input- and weight-gradient counters both, an input-gradient pass ("I") queues
    its weight-gradient pass, run at the schedule's next W slot."""
    counters: dict[tuple[str, int], int] = {}
    queue: list[tuple[int, int]] = []
    order: list[tuple[str, int, int]] = []

    def add(chunk: int, kind: str) -> None:
        mb = counters.get((chunk, "I" if kind == "B" else kind), 0)
        order.append((kind, chunk, mb))
        if kind == "B":
            counters[chunk, "I"] = counters.get((chunk, "I"), 0) + 1
            counters[chunk, "W"] = counters.get((chunk, "W"), 0) + 1
            return
        if kind == "I":
            queue.append((chunk, mb))
        counters[chunk, kind] = mb + 1

    def weight() -> None:
        if queue:
            chunk, mb = queue.pop(0)
            order.append(("W", chunk, mb))
            counters[chunk, "W"] = counters.get((chunk, "W"), 0) + 1

    def overlapped(forward_chunk: int, backward_chunk: int) -> None:
        add(forward_chunk, "F")
        add(backward_chunk, "B")

    for _ in range((p - rank - 1) * 2):
        add(0, "F")
    for _ in range(rank + 1):
        add(0, "F")
        add(1, "F")
    for _ in range(p - rank - 1):
        add(1, "I")
        weight()
        add(1, "F")
    for i in range(m - 2 * p + rank + 1):
        overlapped(0, 1)  # torch's first pair on the last rank is not overlapped: the same two operations
        overlapped(1, 0)
    for _ in range(p - rank - 1):
        add(1, "B")
        overlapped(1, 0)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        if i == half and rank % 2 == 1:
            split = True
        add(1, "I" if split else "B")
        if i == half and rank % 2 == 0:
            split = True
        add(0, "I" if split else "B")
    for _ in range(p - rank - 1):
        weight()
        add(0, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return order


ORDERS = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved": _interleaved_or_1f1b_order,
    "zb-interleaved": _zero_bubble_interleaved_order,
    "zbv": lambda p, m, rank, chunks: _zbv_order(p, m, rank),
    "dualpipev": lambda p, m, rank, chunks: _dualpipev_order(p, m, rank),
}
"""Schedule name (autoplan.layout.SCHEDULE_TABLE) -> (p, m, rank, chunks) -> the rank's operation order: the one place
in the cost model that a schedule is written (tests/test_schedule_table.py checks it names every schedule)."""
