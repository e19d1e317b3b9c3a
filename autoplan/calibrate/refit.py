"""`autoplan calibrate --refit VERIFY_DIR --hardware PROFILE.yaml --out NEW.yaml` (no torch).

Scales a profile's factors so that the plan in VERIFY_DIR would have predicted the step time that
`autoplan verify --measure` measured. The prediction splits into parts (plan.json
predicted.time_breakdown, or verify.json predicted_time_breakdown):

    predicted = fixed + compute_side + comm_side
    fixed         parts the profile does not set: on the CPU (plan for "cpu") compute, recompute, bubble
                  parts come from op times measured on this machine
    compute_side  the other non-communication parts (roofline compute on GPUs, the optimizer step):
                  time ~ 1 / matmul_efficiency, 1 / memory_efficiency, and kernel_overhead (GPUs only:
                  on the CPU the kernel overhead splits measured op times into a fixed and a per-sample
                  part, it does not add time, so a refit leaves the calibrated value alone)
    comm_side     parts named "*comm*" and loss_all_reduce: time ~ latency + bytes / bus bandwidth

A refit multiplies compute-side times by s_compute (efficiencies / s, kernel overhead and the host
overheads hardware/profiles.py HOST_OVERHEADS puts on the compute side x s) and communication times by
s_comm (bus bandwidth / s, latency x s, per collective where calibrated, on the link tiers the plan
used; the comm-side host overheads: DDP, FSDP2, pipelining x s).
With a measured breakdown in verify.json (measured_time_breakdown, same keys) each side gets its own
factor; with only the total, one factor s = (measured - fixed) / (compute_side + comm_side) for both.
Factors are clamped to [1/MAX_FACTOR, MAX_FACTOR] and efficiencies to [MIN_EFFICIENCY, 1]: a bigger
miss points at the model, not at a factor. The step is linear in each part; communication that
overlaps compute responds nonlinearly (a slower link can stop hiding), so the next prediction lands
near, not on, the measurement: verify and refit again to converge.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autoplan.calibrate.writer import profile_text, write_checked
from autoplan.errors import UserError
from autoplan.hardware.profiles import HOST_OVERHEADS, known_hardware, load_hardware, profiles_dir
from autoplan.plan import Plan, PlanError

MAX_FACTOR = 10.0
"""Largest change of a time one refit makes (either way)."""
MIN_EFFICIENCY = 0.01
"""Efficiencies stay in [MIN_EFFICIENCY, 1] (the loader requires (0, 1])."""
MEASURED_ON_CPU = ("compute", "expert_compute", "recompute", "bubble")
"""Breakdown parts that a plan for "cpu" takes from measured op times, not from profile factors."""


def _is_comm(part: str) -> bool:
    """Whether a time-breakdown part is communication (link fits and the comm-side host overheads)."""
    return "comm" in part or part == "loss_all_reduce"


@dataclass(frozen=True)
class RefitResult:
    """What a refit changed."""

    compute_factor: float
    """Compute-side times were multiplied by this (after clamping)."""
    comm_factor: float
    """Communication times were multiplied by this (after clamping)."""
    predicted_before_s: float
    predicted_after_s: float
    """The step time the refitted factors would predict for the same plan (the breakdown, rescaled)."""
    measured_s: float
    notes: tuple[str, ...]
    """Clamps and other things a user should know."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path} not found: {what}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: top level must be an object")
    return raw


def _seconds(raw: dict[str, Any], key: str, path: Path) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{path}: {key} is {value!r}, not a positive number of seconds: "
                        f"run `autoplan verify {path.parent} --measure` first")
    return float(value)


def _breakdown(raw: Any, where: str) -> dict[str, float]:
    if not isinstance(raw, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                                            for v in raw.values()):
        raise UserError(f"{where} must map part names to non-negative seconds, got {raw!r}")
    return {str(k): float(v) for k, v in raw.items()}


def _profile_path(hardware: str) -> Path:
    path = Path(hardware)
    if path.is_file():
        return path
    if hardware in known_hardware():
        return profiles_dir() / f"{hardware}.yaml"
    load_hardware(hardware)  # raises the loader's message (unknown name, missing file)
    raise UserError(f"cannot find hardware profile {hardware}")


def _clamp(factor: float, notes: list[str], side: str) -> float:
    clamped = min(MAX_FACTOR, max(1 / MAX_FACTOR, factor))
    if clamped != factor:
        notes.append(f"{side} factor {factor:.3g} clamped to {clamped:.3g} (a refit moves times at most "
                     f"{MAX_FACTOR:g}x: check the plan's model of this run)")
    return clamped


def _efficiency(value: float, factor: float, name: str, notes: list[str]) -> float:
    wanted = value / factor
    kept = min(1.0, max(MIN_EFFICIENCY, wanted))
    if kept != wanted:
        notes.append(f"{name} {wanted:.3g} clamped to {kept:.3g}")
    return float(f"{kept:.4g}")


def refit(verify_dir: str | Path, hardware: str, out: str | Path) -> RefitResult:
    """Write `out`: the profile `hardware` with factors scaled to match the run measured in `verify_dir`."""
    verify_dir, out = Path(verify_dir), Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"--out {out} must name a .yaml file (the refitted hardware profile)")
    if not verify_dir.is_dir():
        raise UserError(f"--refit {verify_dir} is not a folder: pass an autoplan output folder that "
                        f"`autoplan verify --measure` ran in")
    report_path = verify_dir / "verify.json"
    report = _read_json(report_path, f"run `autoplan verify {verify_dir} --measure` first")
    measured = _seconds(report, "measured_step_time_s", report_path)
    predicted = _seconds(report, "predicted_step_time_s", report_path)
    plan_path = verify_dir / "plan.json"
    try:
        plan = Plan.from_json(plan_path.read_text()) if plan_path.is_file() else None
    except PlanError as e:
        raise UserError(str(e)) from None
    source_path = _profile_path(hardware)
    profile = load_hardware(str(source_path))
    planned_for = plan.cluster.gpu if plan else report.get("predicted_for")
    if planned_for is not None and planned_for != profile.gpu.name:
        raise UserError(f"{verify_dir} holds a plan for {planned_for!r} but the profile is {profile.gpu.name!r}: "
                        f"refit the profile the plan was made with")

    if "predicted_time_breakdown" in report:
        parts = _breakdown(report["predicted_time_breakdown"], f"{report_path}: predicted_time_breakdown")
    else:
        parts = dict(plan.predicted.time_breakdown) if plan and plan.predicted.time_breakdown else {"compute": predicted}
    total = sum(parts.values())
    if total <= 0:
        raise UserError(f"{verify_dir}: the predicted time breakdown sums to 0 s")
    parts = {k: v * predicted / total for k, v in parts.items()}  # the breakdown, scaled to the prediction
    on_cpu = profile.gpu.name == "cpu"
    fixed = sum(v for k, v in parts.items() if on_cpu and k in MEASURED_ON_CPU)
    comm = sum(v for k, v in parts.items() if _is_comm(k))
    compute = predicted - fixed - comm
    notes: list[str] = []
    if compute + comm <= 0:
        raise UserError(f"{verify_dir}: no part of the predicted {predicted:.4g} s depends on the profile's factors "
                        f"(it is all measured op time), so there is nothing to refit")
    if "measured_time_breakdown" in report and comm > 0 and compute > 0:
        got = _breakdown(report["measured_time_breakdown"], f"{report_path}: measured_time_breakdown")
        measured_comm = sum(v for k, v in got.items() if _is_comm(k))
        measured_compute = sum(v for k, v in got.items() if not _is_comm(k)) - fixed
        s_compute = _clamp(max(measured_compute, 0.0) / compute, notes, "compute")
        s_comm = _clamp(measured_comm / comm, notes, "communication")
    else:
        s = _clamp(max(measured - fixed, 0.0) / (compute + comm), notes, "time")
        s_compute, s_comm = (s if compute > 0 else 1.0), (s if comm > 0 else 1.0)  # no evidence, no change
        if measured < fixed:
            notes.append(f"measured {measured:.4g} s is below the measured op time {fixed:.4g} s alone")

    raw = yaml.safe_load(source_path.read_text(encoding="utf-8"))
    gpu = raw["gpu"]
    gpu["matmul_efficiency"] = _efficiency(profile.gpu.matmul_efficiency, s_compute, "matmul_efficiency", notes)
    gpu["memory_efficiency"] = _efficiency(profile.gpu.memory_efficiency, s_compute, "memory_efficiency", notes)
    if not on_cpu:  # on the CPU it only splits measured op times into fixed and per-sample parts
        gpu["kernel_overhead_us"] = float(f"{profile.gpu.kernel_overhead_s * 1e6 * s_compute:.4g}")
    factors = {"compute": s_compute, "comm": s_comm}
    for name, side in HOST_OVERHEADS.items():
        value = getattr(profile.gpu, f"{name}_s")
        # on the CPU, DTensor ops' host time is inside the measured "compute" part, which a refit leaves alone
        measured_part = on_cpu and name == "dtensor_op_overhead"
        if value > 0 and not measured_part:
            gpu[f"{name}_us"] = float(f"{value * 1e6 * factors[side]:.4g}")
    if profile.gpu.pipeline_compute_slowdown > 0:  # its extra time sits in pipeline_comm
        gpu["pipeline_compute_slowdown"] = float(f"{profile.gpu.pipeline_compute_slowdown * s_comm:.4g}")
    same_links = profile.intra_node == profile.inter_node
    crosses_nodes = plan is None or plan.cluster.num_gpus > plan.cluster.gpus_per_node
    tiers = ["intra_node"] + (["inter_node"] if crosses_nodes or same_links else [])
    for tier in tiers:
        link = getattr(profile, tier)
        raw[tier]["bus_bandwidth_gb_per_s"] = float(f"{link.bus_bandwidth_bytes_per_s / 1e9 / s_comm:.4g}")
        raw[tier]["latency_us"] = float(f"{link.latency_s * 1e6 * s_comm:.4g}")
        for op, fit in link.collectives.items():  # per-operation fits, where calibrate measured them
            raw[tier]["collectives"][op] = {"latency_us": float(f"{fit.latency_s * 1e6 * s_comm:.4g}"),
                                            "bus_bandwidth_gb_per_s": float(f"{fit.bus_bandwidth_bytes_per_s / 1e9 / s_comm:.4g}")}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    what = (f"refit {date} from {verify_dir}: measured {measured:.4g} s/step vs predicted {predicted:.4g} s, "
            f"compute-side times x{s_compute:.3g}, communication x{s_comm:.3g}")
    gpu["source"] = f"{gpu['source']}; {what}"
    for tier in tiers:
        raw[tier]["source"] = f"{raw[tier]['source']}; {what}"
    after = fixed + compute * s_compute + comm * s_comm
    raw["refits"] = list(raw.get("refits") or []) + [{
        "date": date, "verify_dir": str(verify_dir.resolve()), "measured_step_time_s": measured,
        "predicted_step_time_s": predicted, "predicted_after_s": float(f"{after:.4g}"),
        "compute_factor": float(f"{s_compute:.4g}"), "comm_factor": float(f"{s_comm:.4g}"),
        "link_tiers": tiers, "notes": notes,
    }]
    header = [line for line in source_path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    header = [f"# Refitted by `autoplan calibrate --refit {verify_dir}` on {date} from {source_path.name}."] + header
    write_checked(out, profile_text(header, raw))
    return RefitResult(s_compute, s_comm, predicted, after, measured, tuple(notes))
