"""The layouts the search enumerates: families (tp, cp, ep, pp, dp_replicate, dp_shard, reshard, sp, offload,
loss_parallel: a layout.Parallelism whose schedule fields are left at their defaults) times variants (schedule,
virtual stages, micro-batch size, micro-batches, recompute mode: Variant, those fields of a Parallelism); the
recompute mode names what the solver may apply per module. Only layouts that layout.problems() accepts with
the pins are emitted, and only features the program can run (layout.SUPPORTED) unless the caller prices other programs.

Mesh dims in rank order ("pp", "dp_replicate", "dp_shard", "cp", "tp"): tp innermost and within a node.
The search's own scope (not validity): reshard=never shards over every data-parallel rank; HSDP
(dp_replicate > 1 and dp_shard > 1) only with reshard=always, its shard group within a node or over a
power of two of nodes. Context parallelism (when the features allow it and the model's attention can ring):
cp x tp within a node or over whole nodes (a ring across nodes is priced on the inter-node link), and only
while each rank keeps at least MIN_CONTEXT_PARALLEL_TOKENS of a sequence (shorter shards make every ring step
latency-bound, and short sequences need no cp). Expert parallelism (for models with expert layers): every ep
dividing each layer's expert count and the ranks it is folded over, dp_shard x cp x tp (layout.expert_folded_ranks,
as torchtitan and Megatron-Core fold it; a pin may ask for an ep dividing dp x cp x tp, which the layout rules
refuse unless the features price it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoplan.cost.context import Context
from autoplan.errors import UserError
from autoplan.hardware.types import Cluster
from autoplan.layout import (DEFAULT_SCHEDULE, RECOMPUTE, SCHEDULE_BY_NAME, Layout, Parallelism, Scope,
                             expert_folded_ranks, problems, schedule_problems)

MAX_VIRTUAL_STAGES = 8
"""Largest number of stages per pipeline rank tried with the interleaved schedule."""
MIN_CONTEXT_PARALLEL_TOKENS = 1024
"""Fewest tokens of a sequence a context-parallel rank keeps for the search to try that cp (a pin may go lower)."""
SCHEDULE_PREFERENCE = ("1f1b", "interleaved", "zb-interleaved", "zbv", "dualpipev", "gpipe")
"""Among equal step times: 1F1B holds fewer micro-batches than GPipe and needs no virtual stages; the zero-bubble
schedules keep activations to the later weight-gradient pass."""


def compiled(pins: Layout, cluster: Cluster, features: frozenset[str]) -> bool:
    """torch.compile per chain module (plan.json compile.enable): as pinned, else on for GPUs (inductor's
    fused kernels; torchtitan's practice) and off for CPU processes, where inductor's compile time outlasts
    short runs. Never when the features exclude it."""
    if pins.compile is not None:
        return pins.compile == "on"
    return "compile" in features and cluster.gpu.name != "cpu"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def scope_of(ctx: Context) -> Scope:
    """What every layout of a search must fit (layout.problems): the cluster, the batch, the model's
    modules, its tensor-parallel facts and its BatchNorm modules, the features in use."""
    cluster = ctx.cluster
    return Scope(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node,
                 global_batch=ctx.training.global_batch_size, num_modules=len(ctx.chain),
                 whole_reason=ctx.chain.whole_reason, features=ctx.features,
                 tensor_parallel_problems=ctx.facts.problems,
                 sequence_parallel_problem=ctx.facts.sequence_parallel_problem,
                 sequence_local_modules=tuple(m for m, style in ctx.facts.plan.items() if style == "sequence_local"),
                 batch_norm_modules=ctx.batch_norm_modules,
                 loss_parallel_problem=ctx.loss_parallel_problem,
                 host_link=ctx.cluster.hardware.host.link_bandwidth_bytes_per_s > 0,
                 sequence_length=ctx.attention.sequence_length,
                 context_parallel_problem=ctx.attention.context_parallel_problem,
                 num_experts=tuple(layer.num_experts for layer in ctx.experts))


def check_pins(pins: Layout, scope: Scope) -> None:
    """UserError listing every pin that cannot hold, with the arithmetic."""
    found = problems(pins, scope)
    if found:
        raise UserError("pins cannot hold: " + "; ".join(found))


def families(pins: Layout, scope: Scope, rejected: list[str] | None = None) -> list[Parallelism]:
    """Every (tp, cp, ep, pp, dp_replicate, dp_shard, reshard) the pins allow that layout.problems() accepts in
    `scope` (whose tensor_parallel_problems says which tp the model allows); the rules the others of
    those degrees break are added to `rejected` when it is given."""
    gpus, per_node, features = scope.num_gpus, scope.gpus_per_node or scope.num_gpus, scope.features or frozenset()
    out = []
    for tp in [pins.tp] if pins.tp else [t for t in divisors(per_node) if t == 1 or "tp" in features]:
        for cp in context_parallel_options(pins, scope, tp):
            for pp in [pins.pp] if pins.pp else divisors(max(1, gpus // (tp * cp))):
                if problems(replace(pins, tp=tp, pp=pp, cp=cp), scope):
                    continue
                dp = gpus // (tp * pp * cp)
                if pins.dp not in (None, dp):
                    continue
                for ep in expert_parallel_options(pins, scope, expert_folded_ranks(dp, cp, tp)):
                    out += _sharded_families(pins, scope, Layout(dp=dp, tp=tp, cp=cp, ep=ep, pp=pp), rejected)
    return out


def _sharded_families(pins: Layout, scope: Scope, degrees: Layout, rejected: list[str] | None) -> list[Parallelism]:
    """The families of the degrees (dp, tp, cp, ep, pp) of `degrees`: each sharding (and CPU offload) the pins and
    the rules allow."""
    dp, tp, cp, ep, pp = degrees.dp, degrees.tp, degrees.cp, degrees.ep, degrees.pp
    per_node, features = scope.gpus_per_node or scope.num_gpus, scope.features or frozenset()
    out = []
    for shard, reshard in _sharding_options(pins, dp, features, cp):
        if 1 < shard < dp and not _whole_nodes(shard * cp * tp, per_node):
            continue
        if ep > 1 and expert_folded_ranks(shard, cp, tp) % ep and pins.ep is None:  # folded over dp_shard x cp x tp
            continue
        sp = sp_of(pins, tp, scope)
        for offload in _offload_options(pins, shard * cp, reshard, scope):
            family = Parallelism(tp=tp, pp=pp, dp_replicate=dp // shard, dp_shard=shard, reshard=reshard, sp=sp,
                                 offload=offload, loss_parallel=tp == 1 or not scope.loss_parallel_problem, cp=cp,
                                 ep=ep)
            layout = replace(pins, dp=dp, dp_replicate=dp // shard, dp_shard=shard,
                             reshard="always" if reshard else "never", tp=tp, pp=pp, cp=cp, ep=ep,
                             sp="on" if sp else pins.sp, offload="cpu" if offload else "none")
            broken = problems(layout, scope)
            if broken and sp and pins.sp is None and not problems(replace(layout, sp=None), scope):
                # sp was on by default and a rule refuses it here: the family runs without it
                family, layout, broken = replace(family, sp=False), replace(layout, sp=None), []
            if not broken:
                out.append(family)
            elif rejected is not None:
                rejected += broken
    return out


def context_parallel_options(pins: Layout, scope: Scope, tp: int) -> list[int]:
    """cp degrees to try with `tp`: the pin; else 1, and when the features allow context parallelism and the
    model's attention can ring, every cp dividing the GPUs beside tp that leaves each rank at least
    MIN_CONTEXT_PARALLEL_TOKENS tokens of a sequence split into 2 x cp equal chunks, its cp x tp ranks within a node
    or over whole nodes (the ring crosses nodes as torchtitan's tp 8 x cp 4 does: the mesh puts cp just outside tp,
    so Context.groups prices its exchange on the link those ranks share)."""
    if pins.cp:
        return [pins.cp]
    seq, per_node = scope.sequence_length, scope.gpus_per_node or scope.num_gpus
    gpus = scope.num_gpus or per_node
    if "cp" not in (scope.features or frozenset()) or scope.context_parallel_problem or not seq or per_node % tp:
        return [1]
    return [c for c in divisors(gpus // tp)
            if c == 1 or (seq % (2 * c) == 0 and seq // c >= MIN_CONTEXT_PARALLEL_TOKENS
                          and _node_aligned(c * tp, per_node))]


def _node_aligned(ranks: int, gpus_per_node: int) -> bool:
    """`ranks` consecutive ranks fill part of one node evenly or whole nodes."""
    return gpus_per_node % ranks == 0 if ranks <= gpus_per_node else ranks % gpus_per_node == 0


def expert_parallel_options(pins: Layout, scope: Scope, ranks: int) -> list[int]:
    """ep degrees to try over `ranks` (dp x cp x tp, layout.expert_folded_ranks) ranks: the pin; else 1, and when the
    features allow expert parallelism, every divisor of the layers' expert counts that divides `ranks`."""
    if pins.ep:
        return [pins.ep]
    experts = scope.num_experts
    if "ep" not in (scope.features or frozenset()) or not experts:
        return [1]
    return [e for e in divisors(math.gcd(*experts)) if ranks % e == 0]


def sp_of(pins: Layout, tp: int, scope: Scope) -> bool:
    """sp of a family: the pin, else on whenever tp > 1 and the program can run it on this model."""
    if tp == 1:
        return False
    if pins.sp is not None:
        return pins.sp == "on"
    return "sp" in (scope.features or frozenset()) and not scope.sequence_parallel_problem


def _offload_options(pins: Layout, shard: int, reshard: bool, scope: Scope) -> list[bool]:
    """CPU offload off, and on for FSDP with resharding when the hardware has a host-device link
    (Scope.host_link) and the pins allow; a pin offload=cpu keeps it on (layout.problems says where it
    cannot be)."""
    if pins.offload == "cpu":
        return [True]
    can = shard > 1 and reshard and scope.host_link and "offload" in (scope.features or frozenset())
    return [False] + ([True] if can and pins.offload is None else [])


def _whole_nodes(ranks: int, gpus_per_node: int) -> bool:
    """HSDP shards within a node, or over a power of two of whole nodes (the usual topologies)."""
    if ranks <= gpus_per_node:
        return gpus_per_node % ranks == 0
    nodes = ranks // gpus_per_node
    return ranks % gpus_per_node == 0 and nodes & (nodes - 1) == 0


def _sharding_options(pins: Layout, dp: int, features: frozenset[str], cp: int = 1) -> list[tuple[int, bool]]:
    """(dp_shard, reshard) pairs to try: DDP, FSDP2 over every data-parallel rank without and with
    resharding, and HSDP's smaller shard groups (resharding); a zero pin keeps its own. With cp > 1 the
    states are sharded over dp_shard x cp whatever dp_shard, so dp = 1 still shards (over cp)."""
    wanted = {0: [(1, False)], 1: [(dp, False)], 2: [(dp, False)], 3: [(dp, True)]}
    if cp > 1 and dp == 1:
        if pins.zero is not None:
            return [(1, pins.zero == 3)] if pins.zero > 0 else []
        return [(1, False)] + ([(1, True)] if "zero3" in features else [])
    if pins.zero is not None:
        options = wanted[pins.zero] if dp > 1 or pins.zero == 0 else []
    elif dp == 1:
        options = [(1, False)]
    else:
        options = [(1, False)] + ([(dp, False)] if "zero2" in features else []) \
            + ([(dp, True)] if "zero3" in features else [])
    if "hsdp" in features and any(reshard for _, reshard in options):
        options += [(s, True) for s in divisors(dp) if 1 < s < dp]
    return options


def virtual_stages_tried(schedule: str) -> range:
    """Stages per rank the search tries with `schedule` (layout.SCHEDULE_TABLE): from its searched_from (interleaved
    from 2: with 1 it runs as 1F1B), up to its most or MAX_VIRTUAL_STAGES."""
    facts = SCHEDULE_BY_NAME[schedule]
    return range(facts.searched_from, (facts.virtual_stages[1] or MAX_VIRTUAL_STAGES) + 1)


@dataclass(frozen=True)
class Variant:
    """The micro-batch schedule of a layout: these fields of a Parallelism (with_variant sets them on a family). Its
    own small value because the search prices each (dp, tp, pp, cp) shape's variants once for every family of it."""

    schedule: str
    virtual_stages: int
    microbatch: int
    microbatches: int
    recompute: str


def variants(family: Parallelism, pins: Layout, scope: Scope, rejected: list[str] | None = None) -> list[Variant]:
    """Every (schedule, virtual stages, micro-batch size, recompute mode) of `family` the pins allow that
    layout.problems() accepts; the rules the others break are added to `rejected` when it is given. They depend
    on the family's dp, tp, pp and cp alone (the search prices each such shape's variants once; a zero-bubble
    schedule's rules read dp and cp)."""
    features = scope.features or frozenset()
    per_rank = scope.global_batch // family.dp
    pp = family.pp
    if pp == 1:
        schedules = [(pins.schedule or DEFAULT_SCHEDULE, 1)]
    else:
        names = [pins.schedule] if pins.schedule else [s for s in SCHEDULE_PREFERENCE if s in features]
        schedules = [(name, v) for name in names
                     for v in ([pins.virtual_stages] if pins.virtual_stages else virtual_stages_tried(name))]
    sizes = [pins.microbatch] if pins.microbatch else divisors(per_rank)
    modes = [pins.recompute] if pins.recompute else [r for r in RECOMPUTE if r == "none" or r in features]
    modes = [r for r in modes if not problems(Layout(recompute=r), scope)]  # e.g. BatchNorm: none only
    base = Layout(dp=family.dp, tp=family.tp, pp=pp, cp=family.cp)
    out = []
    for schedule, virtual_stages in schedules:
        for microbatch in sizes:
            shape = replace(base, schedule=schedule, virtual_stages=virtual_stages, microbatch=microbatch,
                            microbatches=per_rank // microbatch if per_rank % microbatch == 0 else None)
            if shape.microbatches is None:
                continue
            broken = schedule_problems(shape, scope)  # the family passed the rest
            if broken:
                if rejected is not None:
                    rejected += broken
                continue
            out += [Variant(schedule, virtual_stages, microbatch, shape.microbatches, mode) for mode in modes
                    if mode == "none" or not schedule_problems(replace(shape, recompute=mode), scope)]
    return out


def parallelism(family: Parallelism, variant: Variant, recompute: str) -> Parallelism:
    """`family` with `variant`'s schedule fields, the modules recomputed with `recompute`."""
    return replace(family, schedule=variant.schedule, virtual_stages=variant.virtual_stages,
                   microbatch=variant.microbatch, microbatches=variant.microbatches, recompute=recompute)


def describe(par: Parallelism) -> str:
    """The layout in one line of short names (Parallelism.text)."""
    return par.text()


def modes_for(recompute: str, pinned: bool) -> tuple[str, ...]:
    """Recompute modes the solver may give modules: a pin fixes every module, else none or the mode."""
    if pinned or recompute == "none":
        return (recompute,)
    return ("none", recompute)


def leanness(var: Variant) -> tuple:
    """Order variants from the least memory: small micro-batches, most recompute, the default schedule (1F1B)."""
    return (var.microbatch, -RECOMPUTE.index(var.recompute), var.schedule != DEFAULT_SCHEDULE, var.virtual_stages)
