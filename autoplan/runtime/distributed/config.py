"""ParallelConfig: the part of a plan that autoplan.parallelize applies to a model.

A Plan (plan.json) holds predictions, alternatives and the training settings as well; parallelize needs
only the layout and the module lists. The generated train.py builds this from the constants at its top
(editing them changes what runs); a user's own loop passes the Plan, and ParallelConfig.of reads it.
Torch-free: it is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.layout import DEFAULT_SCHEDULE


@dataclass(frozen=True)
class ParallelConfig:
    """How to split one model over the processes, in the generated train.py's words."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP; HSDP's replicate dimension)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2)."""
    reshard: str = "never"
    """FSDP2 frees gathered parameters after forward ("always", ZeRO-3) or keeps them ("never")."""
    tp: int = 1
    """Tensor-parallel ranks (the innermost mesh dimension)."""
    sequence_parallel: bool = True
    """With tp > 1: the ops between the tensor-parallel pairs run on sequence shards."""
    loss_parallel: bool = True
    """With tp > 1 and a vocabulary-sharded head: cross-entropy on the sharded logits."""
    cp: int = 1
    """Context-parallel ranks (mesh dimension between dp_shard and tp): they train the same samples, each its
    share of every sequence from the first chain module that calls scaled_dot_product_attention on (ring
    attention); the model states are FSDP2-sharded over dp_shard x cp."""
    ep: int = 1
    """Expert-parallel ranks, folded over the dp_shard x cp x tp ranks of a pipeline rank and replica: each group of
    ep consecutive ones (tp innermost) splits every experts module's experts (runtime/distributed/expert_parallel.py, all-to-all
    dispatch); the dp_shard x cp x tp / ep groups hold the same experts. Not a mesh dimension of its own: it does not
    change the number of processes."""
    pp: int = 1
    """Pipeline ranks (the outermost mesh dimension)."""
    virtual_stages: int = 1
    """Stages per pipeline rank: stage s runs on pipeline rank autoplan.layout.stage_rank(s, pp, placement)."""
    schedule: str = DEFAULT_SCHEDULE
    """Pipeline schedule, one of autoplan.layout.SCHEDULES."""
    microbatch_size: int = 1
    """Samples per micro-batch."""
    num_microbatches: int = 1
    """Micro-batches per step per data-parallel rank (gradient accumulation when pp = 1)."""
    recompute: str = "none"
    """Activation checkpointing of recompute_modules: "none", "selective" or "full"."""
    recompute_modules: tuple[str, ...] = ()
    """The modules recomputed in backward (FQNs)."""
    offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and optimizer state in host memory."""
    compile: bool = False
    """torch.compile each chain module."""
    dtype: str = "fp32"
    """"bf16": mixed precision on GPUs (fp32 on CPU); "fp32"."""
    tensor_parallel_plan: Mapping[str, str] = field(default_factory=dict)
    """nn.Linear FQN -> "colwise" | "rowwise" (when tp > 1)."""
    batch_norm_modules: tuple[str, ...] = ()
    """BatchNorm modules whose statistics are synchronized over the data-parallel ranks."""
    stages: tuple[tuple[str, ...], ...] = ((),)
    """The chain modules (FQNs) each pipeline stage runs, in order; without a pipeline, one stage: all of them."""

    def __post_init__(self) -> None:
        # the generated train.py passes lists (its literals); keep the frozen value hashable and immutable
        object.__setattr__(self, "recompute_modules", tuple(self.recompute_modules))
        object.__setattr__(self, "batch_norm_modules", tuple(self.batch_norm_modules))
        object.__setattr__(self, "stages", tuple(tuple(stage) for stage in self.stages))
        object.__setattr__(self, "tensor_parallel_plan", dict(self.tensor_parallel_plan))
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
                   "ep": self.ep, "pp": self.pp,
                   "virtual_stages": self.virtual_stages, "microbatch_size": self.microbatch_size,
                   "num_microbatches": self.num_microbatches}
        bad = [f"{name} {value!r}" for name, value in degrees.items()
               if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        if bad:
            raise UserError(f"parallel config: degrees must be positive integers, got {', '.join(bad)}")
        if len(self.stages) != self.pp * self.virtual_stages:
            raise UserError(f"parallel config: pp {self.pp} x virtual_stages {self.virtual_stages} = "
                            f"{self.pp * self.virtual_stages} stages, but stages lists {len(self.stages)}")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Processes the layout runs on: pp x dp_replicate x dp_shard x cp x tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def chain_modules(self) -> tuple[str, ...]:
        """Every stage's chain modules, in order."""
        return tuple(u for stage in self.stages for u in stage)

    def arithmetic(self) -> str:
        """"pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2" (for messages)."""
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} x "
                f"tp {self.tp} = {self.world_size}")

    @staticmethod
    def of(plan: Any) -> "ParallelConfig":
        """The layout of a Plan (what its generated train.py's constants hold)."""
        p = plan.parallelism
        return ParallelConfig(
            dp_replicate=p.dp_replicate, dp_shard=p.dp_shard,
            reshard=p.layout().reshard, tp=p.tp, cp=p.cp,
            ep=p.ep,
            sequence_parallel=p.sp, loss_parallel=p.loss_parallel,
            pp=p.pp, virtual_stages=p.virtual_stages,
            schedule=p.schedule, microbatch_size=p.microbatch,
            num_microbatches=p.microbatches, recompute=p.recompute,
            recompute_modules=plan.activation_checkpoint_modules, offload=p.offload,
            compile=plan.compile.enable, dtype=plan.training.dtype, tensor_parallel_plan=plan.tensor_parallel_plan,
            batch_norm_modules=plan.batch_norm_modules,
            stages=tuple(stage.modules for stage in sorted(plan.stages, key=lambda s: s.index)))


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

