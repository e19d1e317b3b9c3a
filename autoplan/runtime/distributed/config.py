"""ParallelConfig: the part of a plan that autoplan.parallelize applies to a model.

A Plan (plan.json) holds predictions, alternatives and the training settings as well; parallelize needs only
the layout, one autoplan.layout.Parallelism (the type the search, the cost model, plan.json and the reports use),
and the model's module lists. The generated train.py builds it from the constants at its top (editing them changes
what runs); a user's own loop passes the Plan, and ParallelConfig.of reads it. Torch-free: it is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.layout import RECOMPUTE, SCHEDULES, Parallelism


@dataclass(frozen=True)
class ParallelConfig:
    """How to split one model over the processes: the layout and the modules it names (torchtitan's
    ParallelismConfig beside the model's module lists)."""

    parallelism: Parallelism = field(default_factory=Parallelism)
    """The layout: degrees, schedule, micro-batching, recompute mode, sp, loss_parallel, reshard, offload (its
    derived facts, dp, world_size, stage_rank(s), ... are Parallelism's)."""
    stages: tuple[tuple[str, ...], ...] = ((),)
    """The chain modules (FQNs) each pipeline stage runs, in order; without a pipeline, one stage: all of them."""
    tensor_parallel_plan: Mapping[str, str] = field(default_factory=dict)
    """nn.Linear FQN -> "colwise" | "rowwise" | "replicate" | "sequence_local" (when tp > 1)."""
    recompute_modules: tuple[str, ...] = ()
    """The modules recomputed in backward (FQNs), in the parallelism's recompute mode."""
    batch_norm_modules: tuple[str, ...] = ()
    """BatchNorm modules whose statistics are synchronized over the data-parallel ranks."""
    compile: bool = False
    """torch.compile each chain module."""
    dtype: str = "fp32"
    """"bf16": mixed precision on GPUs (fp32 on CPU); "fp32"."""

    def __post_init__(self) -> None:
        # the generated train.py passes lists (its literals); keep the frozen value hashable and immutable
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        object.__setattr__(self, "batch_norm_modules", tuple(self.batch_norm_modules))
        object.__setattr__(self, "stages", tuple(tuple(stage) for stage in self.stages))
        object.__setattr__(self, "tensor_parallel_plan", dict(self.tensor_parallel_plan))
        if not isinstance(self.parallelism, Parallelism):
            raise UserError(f"parallel config: parallelism must be an autoplan.Parallelism, got "
                            f"{type(self.parallelism).__name__}")
        bad = parallelism_problems(self.parallelism)
        if bad:
            raise UserError(f"parallel config: {', '.join(bad)}")
        p = self.parallelism
        if len(self.stages) != p.pp * p.virtual_stages:
            raise UserError(f"parallel config: pp {p.pp} x virtual_stages {p.virtual_stages} = "
                            f"{p.pp * p.virtual_stages} stages, but stages lists {len(self.stages)}")

    @property
    def chain_modules(self) -> tuple[str, ...]:
        """Every stage's chain modules, in order."""
        return tuple(u for stage in self.stages for u in stage)

    @staticmethod
    def of(plan: Any) -> "ParallelConfig":
        """The layout and module lists of a Plan (what its generated train.py's constants hold)."""
        return ParallelConfig(
            parallelism=plan.parallelism,
            stages=tuple(stage.modules for stage in sorted(plan.stages, key=lambda s: s.index)),
            tensor_parallel_plan=plan.tensor_parallel_plan, recompute_modules=plan.activation_checkpoint_modules,
            batch_norm_modules=plan.batch_norm_modules, compile=plan.compile.enable, dtype=plan.training.dtype)


def parallelism_problems(parallelism: Parallelism) -> list[str]:
    """The fields of a Parallelism built by hand (train.py's constants) that the runtime cannot read: a value of
    another type than the field's ("reshard must be True or False, got 'always'"), a degree below 1, a schedule or
    recompute mode outside the vocabulary. Each as "name: what"."""
    out = []
    for f in fields(Parallelism):
        value = getattr(parallelism, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            out.append(f"{f.name} must be True or False, got {value!r}")
        elif f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            out.append(f"{f.name} must be a positive integer, got {value!r}")
    for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE)):
        value = getattr(parallelism, name)
        if value not in allowed:
            out.append(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return out


def as_config(plan: Any) -> ParallelConfig:
    """A ParallelConfig from a ParallelConfig, a Plan, or the path of a plan.json or of an output folder."""
    from pathlib import Path

    from autoplan.plan import Plan, load_plan

    if isinstance(plan, ParallelConfig):
        return plan
    if isinstance(plan, Plan):
        return ParallelConfig.of(plan)
    if isinstance(plan, (str, Path)):
        return ParallelConfig.of(load_plan(plan))
    raise UserError(f"plan must be an autoplan.Plan, the path of a plan.json or of an autoplan output folder, or "
                    f"a ParallelConfig; got {type(plan).__name__}")
