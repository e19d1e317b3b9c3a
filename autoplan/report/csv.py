"""ops.csv, modules.csv, stages.csv and candidates.csv (pandas)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from autoplan.profile_data import ModelProfile

OPS_COLUMNS = ["node", "op", "module", "input_shapes", "dtype", "flops_fwd", "flops_bwd", "param_bytes",
               "saved_bytes", "output_bytes", "time_fwd_s", "time_bwd_s", "source"]
MODULE_COLUMNS = ["module", "depth", "ops", "flops_fwd", "flops_bwd", "param_count", "param_bytes",
                  "saved_bytes", "time_fwd_s", "time_bwd_s"]
CANDIDATE_COLUMNS = ["rank", "dp_replicate", "dp_shard", "reshard", "tp", "sp", "pp", "schedule", "virtual_stages",
                     "microbatch", "microbatches", "recompute", "recompute_modules", "offload", "compile",
                     "gradient_sync", "fits", "step_time_s", "peak_memory_gib", "host_memory_gib", "reason", "cp", "ep",
                     "bubble_s", "schedule_tradeoff"]
"""Layout columns by their short names (autoplan/layout.py VOCABULARY). gradient_sync is "collectives" for every
searched layout and "parameter_server" for the one row that prices a parameter server (solve/parameter_server.py).
bubble_s is the pipeline's predicted idle time per step; schedule_tradeoff, for a zero-bubble schedule (backward split
into input- and weight-gradient passes), what it gains and costs against the best priced non-split schedule of the
same degrees (bubble saved, peak memory added, step time)."""


def ops_frame(profile: ModelProfile) -> pd.DataFrame:
    """One row per op; a parameter's bytes are charged to the first op that reads it."""
    seen: set[str] = set()
    rows = []
    for op in profile.ops:
        fresh = [p for p in op.params if p not in seen and p in profile.parameters]
        seen.update(fresh)
        param_bytes = sum(profile.parameters[p] for p in fresh) * profile.parameter_bytes_per_element
        rows.append({
            "node": op.node, "op": op.op, "module": op.module,
            "input_shapes": " ".join("x".join(map(str, s)) or "scalar" for s in op.input_shapes),
            "dtype": op.dtype, "flops_fwd": op.flops_fwd, "flops_bwd": op.flops_bwd, "param_bytes": param_bytes,
            "saved_bytes": op.saved_bytes, "output_bytes": op.output_bytes,
            "time_fwd_s": op.time_fwd_s, "time_bwd_s": op.time_bwd_s, "source": op.source,
        })
    return pd.DataFrame(rows, columns=OPS_COLUMNS)


def modules_frame(profile: ModelProfile, ops: pd.DataFrame | None = None) -> pd.DataFrame:
    """Roll ops up into every enclosing module, at every depth (DeepSpeed-profiler style)."""
    ops = ops_frame(profile) if ops is None else ops
    totals: dict[str, dict[str, float]] = {}
    for op, row in zip(profile.ops, ops.itertuples(index=False)):
        for module in ("",) + tuple(op.module_stack):
            t = totals.setdefault(module, {"ops": 0, "flops_fwd": 0.0, "flops_bwd": 0.0, "param_bytes": 0,
                                           "saved_bytes": 0, "time_fwd_s": 0.0, "time_bwd_s": 0.0})
            t["ops"] += 1
            for key in ("flops_fwd", "flops_bwd", "param_bytes", "saved_bytes", "time_fwd_s", "time_bwd_s"):
                t[key] += getattr(row, key)
    counts = _parameters_under(profile.parameters)
    rows = []
    for module, t in totals.items():
        rows.append({
            "module": module or "(model)", "depth": module.count(".") + 1 if module else 0, **t,
            "param_count": counts.get(module, 0),
        })
    frame = pd.DataFrame(rows, columns=MODULE_COLUMNS)
    return frame.sort_values(["depth", "module"], kind="stable").reset_index(drop=True)


def _parameters_under(parameters: dict[str, int]) -> dict[str, int]:
    """Module FQN ("" for the model) -> elements of the parameters under it, each parameter counted once per
    enclosing module (one pass over the names, not one per module)."""
    counts: dict[str, int] = {}
    for name, n in parameters.items():
        parts = name.split(".")
        for depth in range(len(parts)):
            module = ".".join(parts[:depth])
            counts[module] = counts.get(module, 0) + n
    return counts


def candidates_frame(candidates: tuple[Any, ...], best: Any, parameter_server: Any = None) -> pd.DataFrame:
    """Every layout tried, fastest fitting first, with why it lost; with `parameter_server`
    (solve.parameter_server.ParameterServerLayout) its row too, in its place by fit and step time."""
    keyed = [((c is not best, not c.fits, c.predicted.step_time_s if c.predicted else float("inf")),
              {**_row(c, best), **_schedule_columns(c, candidates)}) for c in candidates]
    if parameter_server is not None:
        ps = parameter_server
        keyed.append(((True, not ps.fits, ps.step_time_s), _parameter_server_row(ps)))
    rows = [{**row, "rank": rank} for rank, (_, row) in enumerate(sorted(keyed, key=lambda k: k[0]), start=1)]
    return pd.DataFrame(rows, columns=CANDIDATE_COLUMNS)


def _row(c: Any, best: Any) -> dict[str, Any]:
    """A searched layout's columns (all but rank)."""
    p = c.parallelism
    return {
        "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard,
        "reshard": p.layout().reshard, "tp": p.tp,
        "sp": "on" if p.sp else "off", "pp": p.pp,
        "schedule": p.schedule, "virtual_stages": p.virtual_stages,
        "microbatch": p.microbatch, "microbatches": p.microbatches,
        "recompute": p.recompute, "recompute_modules": len(c.activation_checkpoint_modules),
        "offload": "cpu" if p.offload else "none",
        "compile": "on" if getattr(c, "compile", False) else "off", "gradient_sync": "collectives",
        "fits": c.fits,
        "step_time_s": c.predicted.step_time_s if c.predicted else None,
        "peak_memory_gib": c.predicted.peak_memory_bytes / 2**30 if c.predicted else None,
        "host_memory_gib": c.predicted.host_memory_per_node_bytes / 2**30 if c.predicted else None,
        "reason": "chosen" if c is best else c.reason,
        "cp": p.cp, "ep": p.ep,
    }


def _bubble_s(c: Any) -> float | None:
    return c.predicted.time_breakdown.get("bubble") if c.predicted else None


def _schedule_columns(c: Any, candidates: tuple[Any, ...]) -> dict[str, Any]:
    """bubble_s, and for a zero-bubble schedule its trade-off against the fastest fitting non-split schedule of the
    same degrees (and compile)."""
    from autoplan.layout import SCHEDULE_BY_NAME  # the vocabulary's table: which schedules split backward

    out: dict[str, Any] = {"bubble_s": _bubble_s(c), "schedule_tradeoff": ""}
    p = c.parallelism
    facts = SCHEDULE_BY_NAME.get(p.schedule)
    if facts is None or not facts.split_backward or p.pp == 1 or not c.predicted:
        return out

    def degrees(q: Any) -> tuple[int, ...]:
        return (q.tp, q.pp, q.dp_replicate,
                q.dp_shard, q.cp, q.ep)

    def same_layout(o: Any) -> bool:
        q = o.parallelism
        return (o.predicted is not None and o.fits and degrees(q) == degrees(p)
                and getattr(o, "compile", False) == getattr(c, "compile", False)
                and q.schedule in SCHEDULE_BY_NAME
                and not SCHEDULE_BY_NAME[q.schedule].split_backward)

    rivals = sorted((o for o in candidates if same_layout(o)), key=lambda o: o.predicted.step_time_s)
    if not rivals:
        out["schedule_tradeoff"] = "no fitting non-split schedule of these degrees was priced"
        return out
    rival = rivals[0]
    q = rival.parallelism
    name = q.schedule + (f" v={q.virtual_stages}"
                                           if q.virtual_stages > 1 else "")
    saved = (_bubble_s(rival) or 0.0) - (_bubble_s(c) or 0.0)
    memory = (c.predicted.peak_memory_bytes - rival.predicted.peak_memory_bytes) / 2**30
    step = c.predicted.step_time_s - rival.predicted.step_time_s
    verdict = "faster" if step < 0 else "slower"
    out["schedule_tradeoff"] = (f"vs {name}: bubble {saved * 1e3:+.3g} ms saved, peak memory {memory:+.3g} GiB, "
                                f"step {abs(step) * 1e3:.3g} ms {verdict}" + ("" if c.fits else " (does not fit)"))
    return out


def _parameter_server_row(ps: Any) -> dict[str, Any]:
    """The parameter-server layout's columns: its workers' layout, gradient_sync=parameter_server, the servers'
    host memory per node."""
    p = ps.parallelism
    return {
        "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard,
        "reshard": p.layout().reshard, "tp": p.tp, "sp": "off",
        "pp": p.pp, "schedule": p.schedule,
        "virtual_stages": p.virtual_stages, "microbatch": p.microbatch,
        "microbatches": p.microbatches, "recompute": p.recompute,
        "recompute_modules": 0, "offload": "none", "compile": "on" if ps.compile else "off",
        "gradient_sync": "parameter_server",
        "fits": ps.fits, "step_time_s": ps.step_time_s, "peak_memory_gib": ps.peak_memory_bytes / 2**30,
        "host_memory_gib": ps.host_memory_per_node_bytes / 2**30, "reason": ps.reason,
        "cp": p.cp, "ep": p.ep,
    }


def stages_frame(plan) -> pd.DataFrame:
    rows = []
    for s in plan.stages:
        rows.append({"stage": s.index, "modules": " ".join(s.modules), "predicted_time_s": s.predicted_time_s,
                     "predicted_memory_gib": s.predicted_memory_bytes / 2**30,
                     **{f"{k}_gib": v / 2**30 for k, v in s.memory_breakdown.items()}})
    return pd.DataFrame(rows)


def write_csvs(result, out: Path) -> None:
    """Write the four CSVs of a PlanResult into `out`."""
    ops = ops_frame(result.profile)
    ops.to_csv(out / "ops.csv", index=False)
    modules_frame(result.profile, ops).to_csv(out / "modules.csv", index=False)
    stages_frame(result.plan).to_csv(out / "stages.csv", index=False)
    best = next((c for c in result.candidates if c.fits and c.parallelism == result.plan.parallelism
                 and c.stages == result.plan.stages and c.compile == result.plan.compile.enable), None)
    parameter_server = getattr(result, "parameter_server", None)
    candidates_frame(result.candidates, best, parameter_server).to_csv(out / "candidates.csv", index=False)
