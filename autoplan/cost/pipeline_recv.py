"""Where each rank of a torch.distributed.pipelining schedule posts its receives.

Gloo (and NCCL) point-to-point transfers are rendezvous: data moves only once the receiver has posted
its receive (on 2 CPU gloo ranks a receive posted 50 ms after the send still took the whole transfer
time, 0.4-4 ms for 64 KiB-4 MiB). So a transfer starts at the later of the send and the receive's
posting, and where a schedule posts its receives decides how much of the transfer hides behind the
receiver's compute.

- Single-stage schedules (ScheduleGPipe, Schedule1F1B, PipelineScheduleSingle) post a stage's receive
  right before the operation that consumes it and wait for it: the transfer cannot overlap the
  receiver's previous operation.
- Multi-stage schedules (ScheduleInterleaved1F1B, _PipelineScheduleRuntime) lower the compute order to
  a list of actions: UNSHARD/RESHARD around each stage's use (schedules._add_unshard_reshard, three
  stages active), REDUCE_GRAD after a stage's last backward (_add_reduce_grad), then sends and receives
  (_add_send_recv): ranks take turns popping one action each, a compute action only once its input is
  scheduled, and a sender appends the receive to the receiver's list where that list stands. The
  runtime posts it there, without waiting. This module replays that lowering on the cost model's
  operation orders.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from autoplan.layout import rank_stages, stage_rank

Operation = tuple[str, int, int]
"""("F" | "B", chunk, microbatch) as cost/pipeline.rank_order lists them."""
ACTIVE_STAGES = 3
"""Stages the runtime keeps unsharded at once (schedules._add_unshard_reshard's max_active_stages)."""


def _upcoming(stages: list[int]) -> list[list[int]]:
    """For each position, the first ACTIVE_STAGES distinct stages from it on (built from the end: linear in the
    operations, which a deep schedule has 10^4 of)."""
    out: list[list[int]] = [[] for _ in stages]
    after: list[int] = []
    for i in reversed(range(len(stages))):
        after = ([stages[i]] + [s for s in after if s != stages[i]])[:ACTIVE_STAGES]
        out[i] = after
    return out


def _with_bookkeeping(order: Sequence[Operation], local: Sequence[int], m: int) -> list[Operation | None]:
    """The rank's compute order (`local`: its stages, by chunk) with None where the runtime lowering puts a
    non-compute action (UNSHARD, RESHARD, REDUCE_GRAD): each takes one turn of the send/recv lowering."""
    stages = [local[chunk] for _, chunk, _ in order]
    active: set[int] = set()
    lowered: list[Operation | None] = []
    for op, upcoming in zip(order, _upcoming(stages)):
        evict = [s for s in active if s not in upcoming]
        fetch = [s for s in upcoming if s not in active]
        active.difference_update(evict)
        active.update(fetch)
        lowered += [None] * (len(evict) + len(fetch)) + [op]
    lowered += [None] * len(active)
    with_reduce: list[Operation | None] = []
    backwards: dict[int, int] = {}
    for op in lowered:
        with_reduce.append(op)
        if op is not None and op[0] == "B":
            stage = local[op[1]]
            backwards[stage] = backwards.get(stage, 0) + 1
            if backwards[stage] == m:
                with_reduce.append(None)
    return with_reduce


def receive_posted_after(orders: Sequence[Sequence[Operation]], m: int, chunks: int,
                         placement: str = "loop") -> dict[tuple[str, int, int], int]:
    """For each output sent between ranks, ("F" | "B", producing stage, microbatch) -> the index in the
    receiving rank's order of the operation after which the receive is posted (-1: at the start).
    Stage s runs on rank autoplan.layout.stage_rank(s, p, placement); `orders[r]` is rank r's operation order."""
    p = len(orders)
    last = p * chunks - 1
    local = [rank_stages(r, p, chunks, placement) for r in range(p)]

    def receiver(kind: str, stage: int) -> int | None:
        neighbour = stage + 1 if kind == "F" else stage - 1
        if not 0 <= neighbour <= last:
            return None
        peer = stage_rank(neighbour, p, placement)
        return None if peer == stage_rank(stage, p, placement) else peer

    posted: dict[tuple[str, int, int], int] = {}
    if chunks == 1:  # post right before the consuming operation
        for r, order in enumerate(orders):
            for index, (kind, chunk, mb) in enumerate(order):
                stage = local[r][chunk]
                producer = ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb)
                if 0 <= producer[1] <= last and receiver(*producer[:2]) == r:
                    posted[producer] = index - 1
        return posted
    pending = [deque(_with_bookkeeping(order, local[r], m)) for r, order in enumerate(orders)]
    scheduled: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]  # computed here or received
    computed = [0] * p
    while any(pending):
        progress = False
        for r in range(p):
            if not pending[r]:
                continue
            op = pending[r][0]
            if op is not None:
                kind, chunk, mb = op
                stage = local[r][chunk]
                needed = ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb)
                if 0 <= needed[1] <= last and needed not in scheduled[r]:
                    continue
                computed[r] += 1
                produced = (kind, stage, mb)
                scheduled[r].add(produced)
                peer = receiver(kind, stage)
                if peer is not None:
                    posted[produced] = computed[peer] - 1
                    scheduled[peer].add(produced)
            pending[r].popleft()
            progress = True
        if not progress:
            raise ValueError("the schedule's operation orders deadlock: no rank can post its next operation")
    return posted
