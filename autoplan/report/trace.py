"""trace.json: the predicted schedule of one step in Chrome trace event format (Perfetto, chrome://tracing).

One process per pipeline rank, thread 0 = compute and thread 1 = communication; every block is a
complete ("X") event with ts and dur in microseconds. The events are those of the HTML Gantt chart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplan.plan import Plan
from autoplan.report.schedule import COMPUTE_KINDS, LANES, step_schedule

US_PER_S = 1e6
"""Trace timestamps are microseconds (Trace Event Format spec)."""


def trace_events(plan: Plan) -> list[dict[str, Any]]:
    """Metadata events naming processes and threads, then one "X" event per schedule block."""
    events = step_schedule(plan)
    ranks = sorted({e.rank for e in events})
    stage_names = {s.index: list(s.modules) for s in plan.stages}
    out: list[dict[str, Any]] = []
    for rank in ranks:
        stages = sorted({e.stage for e in events if e.rank == rank and e.lane == LANES[0] and e.stage is not None})
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"pipeline rank {rank} (stage {', '.join(map(str, stages))})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, lane in enumerate(LANES):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    for e in events:
        args: dict[str, Any] = {"stage": e.stage, "microbatch": e.microbatch}
        if e.peer is not None:
            args.update(peer_rank=e.peer, payload=e.payload)
        if e.kind in COMPUTE_KINDS and e.stage in stage_names:
            args["modules"] = stage_names[e.stage]
        out.append({"name": e.label, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": LANES.index(e.lane),
                    "ts": _us(e.start_s), "dur": round(_us(e.end_s) - _us(e.start_s), 3),
                    "args": {k: v for k, v in args.items() if v is not None}})
    return out


def _us(seconds: float) -> float:
    return round(seconds * US_PER_S, 3)


def write_trace(plan: Plan, out_dir: Path) -> None:
    """Write out_dir/trace.json."""
    document = {"traceEvents": trace_events(plan), "displayTimeUnit": "ms",
                "otherData": {"source": "autoplan predicted schedule", "schedule":
                              plan.parallelism.pipeline_parallel_schedule,
                              "predicted_step_time_s": plan.predicted.step_time_s}}
    Path(out_dir, "trace.json").write_text(json.dumps(document, indent=1), encoding="utf-8")
