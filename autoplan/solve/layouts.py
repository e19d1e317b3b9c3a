"""Which layouts the search may emit (one switch list), and pins checked with their arithmetic.

Mesh dims in rank order ("pp", "dp_replicate", "dp_shard", "tp"): tp innermost and within a node.
A layout is a family (tp, pp, dp_replicate, dp_shard, zero) times a variant (schedule, virtual stages,
micro-batch size, recompute mode); the recompute mode names what the solver may apply per unit.
zero 1 and 2 run as FSDP2 without resharding after forward (dp_shard = dp); HSDP (dp_replicate > 1
and dp_shard > 1) only with zero 3, its shard group within a node or over a power of two of nodes.
The search emits only what SUPPORTED lists; ALL_FEATURES is what the cost model can price.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.errors import UserError
from autoplan.plan import Parallelism
from autoplan.solve.pins import Pins

ALL_FEATURES = frozenset({
    "tp", "tp_vocab_parallel", "zero2", "zero3", "hsdp", "gpipe", "1f1b", "interleaved", "selective", "full",
    "pp_scatter_gather",  # Megatron-LM's pipeline sends split over tensor-parallel ranks (not in torch)
    "tp_fused_split",     # Megatron-LM's fused qkv with interleaved weights, split per rank (not in torch TP)
})
"""Everything the cost model can price (what estimates of other programs, e.g. Megatron-LM's published
runs, may use even where codegen cannot run it yet)."""

SUPPORTED = frozenset({
    "tp",                 # Megatron colwise/rowwise pairs (Plan.tensor_parallel_plan)
    "zero2",              # FSDP2 reshard_after_forward=False (zero=1 and zero=2)
    "zero3",              # FSDP2 fully_shard
    "hsdp",               # dp_replicate > 1 and dp_shard > 1 with zero 3
    "gpipe",
    "1f1b",
    "interleaved",        # virtual stages (ScheduleInterleaved1F1B)
    "selective",          # selective activation checkpointing per unit
    "full",               # full activation checkpointing per unit
})
"""What codegen can run. Remove a name to stop the search from emitting (or accepting a pin of) it.
Not yet: tp_vocab_parallel (codegen shards nn.Linear pairs only), pp_scatter_gather and tp_fused_split
(not in torch)."""

MAX_VIRTUAL_STAGES = 8
"""Largest number of stages per pipeline rank tried with the interleaved schedule."""
SCHEDULE_PREFERENCE = ("1f1b", "interleaved", "gpipe")
"""Among equal step times: 1F1B holds fewer micro-batches than GPipe and needs no virtual stages."""
RECOMPUTE_PREFERENCE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Family:
    """Degrees and sharding of a layout (what the model states' memory depends on)."""

    tp: int
    pp: int
    replicate: int
    shard: int
    zero: int

    @property
    def dp(self) -> int:
        return self.replicate * self.shard


def unsupported_pins(pins: Pins, features: frozenset[str]) -> list[str]:
    problems = []
    if pins.tp is not None and pins.tp > 1 and "tp" not in features:
        problems.append(f"tensor parallelism is not supported yet (tp={pins.tp}; use tp=1)")
    zero_feature = {1: "zero2", 2: "zero2", 3: "zero3"}.get(pins.zero or 0)
    if zero_feature and zero_feature not in features:
        problems.append(f"zero={pins.zero} is not supported yet (supported: {', '.join(_zeros(features))})")
    if pins.schedule is not None and pins.schedule not in features:
        problems.append(f"schedule={pins.schedule} is not supported yet (supported: {', '.join(_schedules(features))})")
    if pins.recompute not in (None, "none") and pins.recompute not in features:
        problems.append(f"recompute={pins.recompute} is not supported yet")
    return problems


def _zeros(features) -> list[str]:
    return ["0 = DDP"] + (["1/2 = FSDP without resharding"] if "zero2" in features else []) + \
        (["3 = FSDP"] if "zero3" in features else [])


def _schedules(features) -> list[str]:
    return [s for s in SCHEDULE_PREFERENCE if s in features]


def check_pins(pins: Pins, num_gpus: int, gpus_per_node: int, global_batch: int, num_units: int,
               features: frozenset[str], tp_problems: list[str]) -> None:
    """UserError listing every pin that cannot hold, with the arithmetic."""
    problems = unsupported_pins(pins, features) + tp_problems
    tp = pins.tp or 1
    if pins.tp is not None and num_gpus % pins.tp:
        problems.append(f"tp={pins.tp} does not divide {num_gpus} GPUs")
    if pins.tp is not None and gpus_per_node % pins.tp:
        problems.append(f"tp={pins.tp} does not divide the {gpus_per_node} GPUs of a node (tensor parallelism "
                        f"stays inside a node)")
    if pins.pp is not None:
        if num_gpus % pins.pp:
            problems.append(f"pp={pins.pp} does not divide {num_gpus} GPUs")
        if pins.pp > num_units:
            problems.append(f"pp={pins.pp} exceeds the {num_units} layers the model splits into")
    if pins.dp is not None:
        if num_gpus % pins.dp:
            problems.append(f"dp={pins.dp} does not divide {num_gpus} GPUs")
        if global_batch % pins.dp:
            problems.append(f"dp={pins.dp} does not divide the global batch of {global_batch}")
    if pins.dp is not None and pins.pp is not None and pins.dp * pins.pp * tp != num_gpus:
        problems.append(f"dp={pins.dp} x pp={pins.pp} x tp={tp} = {pins.dp * pins.pp * tp}, not {num_gpus} GPUs")
    if pins.microbatch is not None:
        if pins.dp is not None and global_batch % pins.dp == 0 and (global_batch // pins.dp) % pins.microbatch:
            per_rank = global_batch // pins.dp
            problems.append(f"microbatch={pins.microbatch} does not divide the {per_rank} samples per "
                            f"data-parallel rank (global batch {global_batch} / dp={pins.dp})")
        elif pins.microbatch > global_batch:
            problems.append(f"microbatch={pins.microbatch} exceeds the global batch of {global_batch}")
    if (pins.schedule in ("1f1b", "interleaved") and None not in (pins.dp, pins.pp, pins.microbatch) and pins.pp > 1
            and global_batch % (pins.dp * pins.microbatch) == 0):
        m = global_batch // (pins.dp * pins.microbatch)
        if m < pins.pp or (pins.schedule == "interleaved" and m % pins.pp):
            need = "a multiple of" if pins.schedule == "interleaved" else "at least"
            problems.append(f"schedule={pins.schedule} needs {need} pp={pins.pp} micro-batches, but global batch "
                            f"{global_batch} / dp={pins.dp} / microbatch={pins.microbatch} = {m}")
    if pins.schedule == "interleaved" and pins.pp is not None and 2 * pins.pp > num_units:
        problems.append(f"schedule=interleaved needs at least 2 x pp={pins.pp} layers, the model splits into "
                        f"{num_units}")
    if problems:
        raise UserError("pins cannot hold: " + "; ".join(problems))


def families(pins: Pins, num_gpus: int, gpus_per_node: int, global_batch: int, num_units: int,
             features: frozenset[str], tp_ok) -> list[Family]:
    """Every (tp, pp, replicate, shard, zero) within scope that satisfies the pins. `tp_ok(tp)` says
    whether the model's tensor-parallel facts allow tp (tp must also divide the node)."""
    out = []
    tps = [pins.tp] if pins.tp else [t for t in divisors(gpus_per_node)
                                     if num_gpus % t == 0 and (t == 1 or "tp" in features) and tp_ok(t)]
    for tp in tps:
        for pp in divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            if pp > num_units or global_batch % dp or (pins.pp or pp) != pp or (pins.dp or dp) != dp:
                continue
            if pp > 1 and not ({"1f1b", "gpipe", "interleaved"} & features):
                continue
            for zero in _zero_options(pins, dp, features):
                shards = [1] if zero == 0 else [dp]
                if zero == 3 and "hsdp" in features:
                    shards += [s for s in divisors(dp) if 1 < s < dp and _whole_nodes(s * tp, gpus_per_node)]
                for shard in shards:
                    out.append(Family(tp, pp, dp // shard, shard, zero))
    return out


def _whole_nodes(ranks: int, gpus_per_node: int) -> bool:
    """HSDP shards within a node, or over a power of two of whole nodes (the usual topologies)."""
    if ranks <= gpus_per_node:
        return gpus_per_node % ranks == 0
    nodes = ranks // gpus_per_node
    return ranks % gpus_per_node == 0 and nodes & (nodes - 1) == 0


def _zero_options(pins: Pins, dp: int, features: frozenset[str]) -> list[int]:
    if pins.zero is not None:
        return [pins.zero] if dp > 1 or pins.zero == 0 else []
    if dp == 1:
        return [0]
    return [0] + ([2] if "zero2" in features else []) + ([3] if "zero3" in features else [])


@dataclass(frozen=True)
class Variant:
    schedule: str
    virtual: int
    microbatch: int
    num_microbatches: int
    recompute: str


def variants(family: Family, pins: Pins, global_batch: int, num_units: int, features: frozenset[str]) -> list[Variant]:
    per_rank = global_batch // family.dp
    pp = family.pp
    if pp == 1:
        schedules = [(pins.schedule or "1f1b", 1)]
    else:
        names = [pins.schedule] if pins.schedule else [s for s in SCHEDULE_PREFERENCE if s in features]
        schedules = []
        for name in names:
            if name == "interleaved":
                schedules += [(name, v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp * v <= num_units]
            else:
                schedules.append((name, 1))
    sizes = [pins.microbatch] if pins.microbatch else divisors(per_rank)
    modes = [pins.recompute] if pins.recompute else [r for r in RECOMPUTE_PREFERENCE if r == "none" or r in features]
    out = []
    for schedule, virtual in schedules:
        for mbs in sizes:
            if per_rank % mbs:
                continue
            m = per_rank // mbs
            if pp > 1 and schedule != "gpipe" and (m < pp or (schedule == "interleaved" and m % pp)):
                continue  # 1F1B needs m >= p; torch's interleaved 1F1B needs m a multiple of p
            out += [Variant(schedule, virtual, mbs, m, mode) for mode in modes]
    return out


def parallelism(family: Family, variant: Variant, recompute: str) -> Parallelism:
    return Parallelism(
        data_parallel_replicate_degree=family.replicate,
        data_parallel_shard_degree=family.shard,
        tensor_parallel_degree=family.tp,
        pipeline_parallel_degree=family.pp,
        pipeline_parallel_schedule=variant.schedule,
        pipeline_parallel_microbatch_size=variant.microbatch,
        pipeline_parallel_num_microbatches=variant.num_microbatches,
        activation_checkpoint=recompute,
        zero_stage=family.zero,
        pipeline_parallel_virtual_stages=variant.virtual,
    )


def describe(par: Parallelism) -> str:
    text = f"dp={par.data_parallel_degree}"
    if par.data_parallel_replicate_degree > 1 and par.data_parallel_shard_degree > 1:
        text += f" ({par.data_parallel_replicate_degree}x{par.data_parallel_shard_degree} HSDP)"
    text += f" tp={par.tensor_parallel_degree} pp={par.pipeline_parallel_degree} zero={par.zero_stage}"
    if par.pipeline_parallel_degree > 1:
        text += f" schedule={par.pipeline_parallel_schedule}"
        if par.pipeline_parallel_virtual_stages > 1:
            text += f" v={par.pipeline_parallel_virtual_stages}"
    text += f" microbatch={par.pipeline_parallel_microbatch_size} x{par.pipeline_parallel_num_microbatches}"
    if par.activation_checkpoint != "none":
        text += f" recompute={par.activation_checkpoint}"
    return text


def modes_for(recompute: str, pinned: bool) -> tuple[str, ...]:
    """Recompute modes the solver may give units: a pin fixes every unit, else none or the mode."""
    if pinned or recompute == "none":
        return (recompute,)
    return ("none", recompute)


def leanness(var: Variant) -> tuple:
    """Order variants from the least memory: small micro-batches, most recompute, 1F1B."""
    return (var.microbatch, -RECOMPUTE_PREFERENCE.index(var.recompute), var.schedule != "1f1b", var.virtual)
