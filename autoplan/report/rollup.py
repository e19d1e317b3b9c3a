"""Numbers the HTML report shows, derived from a plan, its profile and its candidates (no markup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.layout import SCHEDULE_BY_NAME
from autoplan.plan import Parallelism, Stage
from autoplan.profile_data import ModelProfile

MEMORY_ORDER = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""Memory categories drawn first, in this order; any others follow as the cost model names them."""

OUTSIDE = "(outside the stage modules)"


@dataclass(frozen=True)
class ModuleTime:
    """Profiled time of one stage module (a module of Stage.modules), scaled to one micro-batch."""

    module: str
    """Module FQN (OUTSIDE when the stages name no module the ops ran in)."""
    stage: int
    """Index of the stage the module runs on (-1 for OUTSIDE)."""
    forward_s: float
    """Forward seconds per micro-batch."""
    backward_s: float
    """Backward seconds per micro-batch."""
    ops: int
    """Number of ops rolled up, glue included."""
    glue_ops: int = 0
    """Ops in no module's module (residual adds, root-level ops) charged to this module."""


def module_times(profile: ModelProfile, stages: tuple[Stage, ...], microbatch: int) -> list[ModuleTime]:
    """Roll the profile's ops up to the stage modules, as the module chain charges them
    (autoplan.chain.modules): an op belongs to the innermost stage module in its module_stack; glue ops
    in none go to the module of the nearest preceding op that has one (or the first module).
    Profile times are for profile.batch_size samples and scale linearly to a micro-batch."""
    owner: dict[str, int] = {}
    modules: list[tuple[str, int]] = []
    for stage in sorted(stages, key=lambda s: s.index):
        for module in stage.modules:
            owner.setdefault(module, len(modules))
            modules.append((module, stage.index))
    totals = [[0.0, 0.0, 0, 0] for _ in modules] or [[0.0, 0.0, 0, 0]]
    scale = microbatch / max(1, profile.batch_size)
    previous = 0
    for op in profile.ops:
        module = next((owner[m] for m in reversed((op.module,) + op.module_stack) if m in owner), None)
        bucket = totals[previous if module is None else module]
        previous = previous if module is None else module
        bucket[0] += op.time_fwd_s * scale
        bucket[1] += op.time_bwd_s * scale
        bucket[2] += 1
        bucket[3] += module is None
    if not modules:
        return [ModuleTime(OUTSIDE, -1, *totals[0])] if profile.ops else []
    return [ModuleTime(name, stage, *t) for (name, stage), t in zip(modules, totals)]


def memory_segments(breakdown: dict[str, float], total: float) -> tuple[tuple[str, float], ...]:
    """A memory breakdown in drawing order; the unexplained rest of `total` as "other"."""
    keys = [k for k in MEMORY_ORDER if k in breakdown] + sorted(k for k in breakdown if k not in MEMORY_ORDER)
    segments = [(k, float(breakdown[k])) for k in keys]
    rest = total - sum(v for _, v in segments)
    if rest > 1e-6 * max(total, 1.0):
        segments.append(("other", rest))
    return tuple(segments)


def describe_layout(par: Parallelism | dict[str, Any]) -> str:
    """A short human name of a layout: "DP 2 × PP 4 (1F1B, 8 micro-batches of 1) · recompute full"."""
    if isinstance(par, dict):
        known = {k: v for k, v in par.items() if k in Parallelism.__dataclass_fields__}
        par = Parallelism(**known)
    parts = []
    dp = par.dp
    if dp > 1:
        if par.fsdp_enabled and par.dp_replicate > 1:
            parts.append(f"HSDP {par.dp_replicate}×{par.dp_shard}")
        elif par.reshards_after_forward:
            parts.append(f"FSDP {dp}")
        elif par.fsdp_enabled:
            parts.append(f"FSDP {dp} (no reshard)")
        else:
            parts.append(f"DP {dp}")
    if par.cp > 1:
        parts.append(f"CP {par.cp}")
    if par.tp > 1:
        parts.append(f"TP {par.tp}")
    m, b = par.microbatches, par.microbatch
    if par.pp > 1:
        schedule = SCHEDULE_BY_NAME[par.schedule].display_name
        if par.virtual_stages > 1:
            schedule += f" ×{par.virtual_stages} chunks"
        parts.append(f"PP {par.pp} ({schedule}, {plural(m, 'micro-batch')} of {b})")
    name = " × ".join(parts) or "1 GPU"
    if par.ep > 1:
        name += f" · EP {par.ep} (experts split over {par.ep} of the DP×CP×TP ranks)"
    if par.pp == 1 and m > 1:
        name += f" · {plural(m, 'accumulation step')} of {b}"
    if par.recompute != "none":
        name += f" · recompute {par.recompute}"
    if par.offload:
        name += " · CPU offload"
    return name


def plural(number: int, noun: str) -> str:
    """"1 micro-batch", "4 micro-batches"."""
    return f"{number} {noun}" + ("" if number == 1 else "es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


def chosen_candidate(candidates: tuple[Any, ...], plan) -> Any | None:
    """The candidate the plan was made from (same layout and stages), else the same layout."""
    same = [c for c in candidates if c.parallelism == plan.parallelism
            and getattr(c, "compile", False) == plan.compile.enable]
    exact = [c for c in same if c.fits and tuple(c.stages) == tuple(plan.stages)]
    return (exact or same or [None])[0]


def ranked_candidates(candidates: tuple[Any, ...], best: Any) -> list[Any]:
    """Chosen first, then fitting by step time, then the rest (same order as candidates.csv)."""
    return sorted(candidates, key=lambda c: (c is not best, not c.fits,
                                             c.predicted.step_time_s if c.predicted else float("inf")))


def ideal_scaling(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Linear scaling from the smallest GPU count: what perfect efficiency would give."""
    if not points:
        return []
    base_gpus, base_rate = min(points)
    return [(g, base_rate * g / base_gpus) for g, _ in sorted(points)]
