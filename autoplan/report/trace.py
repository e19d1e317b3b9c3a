"""trace.json: the predicted schedule of one step in Chrome trace event format (Perfetto, chrome://tracing).

One process per pipeline rank, thread 0 = compute and thread 1 = communication; every block is a
complete ("X") event with ts and dur in microseconds. The events are those of the HTML Gantt chart: a step with
more than schedule.DRAWN_EVENTS blocks keeps the first, a steady-state window and the last micro-batches block by
block, and each run of the other blocks on a lane is one "elided" event whose args count its blocks and sum their
busy time, in total and per stage (otherData says which micro-batches are drawn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplan.plan import Plan
from autoplan.report.schedule import (COMPUTE_KINDS, LANES, ElidedSpan, ScheduleView, number_ranges,
                                       schedule_view)

US_PER_S = 1e6
"""Trace timestamps are microseconds (Trace Event Format spec)."""
ELIDED = "elided"
"""Category (cat) of the events that aggregate blocks not drawn one by one."""


def trace_events(plan: Plan, view: ScheduleView | None = None) -> list[dict[str, Any]]:
    """Metadata events naming processes and threads, then one "X" event per schedule block drawn and one per
    elided run."""
    view = schedule_view(plan) if view is None else view
    stage_names = {s.index: list(s.modules) for s in plan.stages}
    rank_stages = view.rank_stages()
    out: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in (*view.events, *view.elided)}):
        stages = rank_stages.get(rank, [])
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"pipeline rank {rank} (stage {', '.join(map(str, stages))})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, lane in enumerate(LANES):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    for e in view.events:
        args: dict[str, Any] = {"stage": e.stage, "microbatch": e.microbatch}
        if e.peer is not None:
            args.update(peer_rank=e.peer, payload=e.payload)
        if e.kind in COMPUTE_KINDS and e.stage in stage_names:
            args["modules"] = stage_names[e.stage]
        out.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": LANES.index(e.lane),
                    "ts": _us(e.start_s), "dur": round(_us(e.end_s) - _us(e.start_s), 3),
                    "args": {k: v for k, v in args.items() if v is not None}})
    out += [_elided_event(span) for span in view.elided]
    return out


def _elided_event(span: ElidedSpan) -> dict[str, Any]:
    low, high = span.microbatches
    return {"name": span.label, "cat": ELIDED, "ph": "X", "pid": span.rank, "tid": LANES.index(span.lane),
            "ts": _us(span.start_s), "dur": round(_us(span.end_s) - _us(span.start_s), 3),
            "args": {"blocks": span.count, "blocks_by_kind": dict(span.kinds), "busy_us": _us(span.busy_s),
                     "idle_us": _us(span.idle_s), "busy_us_by_stage": {str(s): _us(t) for s, t in span.stages},
                     "microbatches": [low, high]}}


def _us(seconds: float) -> float:
    return round(seconds * US_PER_S, 3)


def write_trace(plan: Plan, out_dir: Path, view: ScheduleView | None = None) -> None:
    """Write out_dir/trace.json (`view`: the schedule_view of the plan when the caller has it)."""
    view = schedule_view(plan) if view is None else view
    other: dict[str, Any] = {"source": "autoplan predicted schedule",
                             "schedule": plan.parallelism.schedule,
                             "predicted_step_time_s": plan.predicted.step_time_s}
    if view.elided:
        other["elided"] = (f"{view.microbatches} micro-batches: the blocks of micro-batches "
                           f"{number_ranges(view.drawn_microbatches)} are drawn one by one; each run of the others' "
                           f"blocks on a lane is one '{ELIDED}' event (args: blocks, busy and idle time, busy time per "
                           "stage)")
        other["drawn_microbatches"] = list(view.drawn_microbatches)
        other["simulated_step_time_s"] = view.makespan_s
    document = {"traceEvents": trace_events(plan, view), "displayTimeUnit": "ms", "otherData": other}
    Path(out_dir, "trace.json").write_text(json.dumps(document, indent=1), encoding="utf-8")

