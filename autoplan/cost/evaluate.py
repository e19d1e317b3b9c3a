"""Price one layout with one assignment (stage split + recompute per module): time, memory, MFU.

Step time (seconds), p pipeline ranks with v stages each, m micro-batches, q the slowest rank:

    slot_q  = sum over q's stages of (compute + recompute + tensor-parallel collectives
              + exposed FSDP gathers per micro-batch + the pipelining runtime's host time)
    step    = the pipeline schedule simulated with each stage's forward, backward and boundary
              transfer (cost/pipeline.py; (m + (p - 1) / v) x slot_q for balanced stages and
              free transfers): m x slot_q busy, the rest bubble and exposed transfers
            + max over ranks of exposed gradient reduction (cost/comm.py)
            + all-reduce of tied parameters split over stages
            + max over ranks of the AdamW step            (cost/compute.py; on the CPU with offload)
            + the all-reduce of the step's loss over every rank (train.py logs the global mean)
            + SyncBatchNorm's statistics all-reduces, per micro-batch (batch_norm_sync; cost/comm.py)

Context parallelism (cp) and expert parallelism (ep) change the module table (cost/compute.py sharded_table):
every module's compute, collectives and activations on seq/cp tokens, the experts' compute times the router
imbalance (its own breakdown part "expert_compute", out of "compute": Context.expert_compute_s), plus each module's exposed ring traffic (breakdown "context_parallel_comm") and expert all-to-alls
("expert_parallel_comm"), in its slot like the tensor-parallel collectives; a pipeline's boundary sends carry
the rank's seq/cp share from the first module calling attention on, the whole sequence before it
(Context.rank_cut_bytes, as the program exports its stages). Gradients are reduced over the
dp_shard x cp FSDP group (with dp_replicate); the expert parameters (E/ep per rank) are their own FSDP2 unit in
each module, sharded over the dp_shard x cp / ep ranks holding the same experts (Groups.expert_shard, HSDP's
Groups.expert_replicate beside), their collectives added to the module's and hidden behind the same compute
(cost/comm.py fsdp_comm); beside DDP (priced, not run) their gradients are all-reduced over the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from autoplan.cost import calibration, comm
from autoplan.cost.compute import ModuleTable, host_optimizer_step_time, mfu, model_flops_per_step, optimizer_step_time
from autoplan.cost.context import Context, Groups, expert_shard_degree, gib, memory_layout
from autoplan.cost.dtypes import bytes_per_element
from autoplan.cost.memory import LayoutMemory, MemoryInputs, host_state_bytes
from autoplan.cost.pipeline import StageCost, microbatches_in_flight, simulated_step_s
from autoplan.cost.problem import Assignment, ChainProblem, single_stage_memory
from autoplan.cost.problem import memory_lower_bound as problem_memory_lower_bound
from autoplan.layout import SCHEDULE_BY_NAME
from autoplan.plan import Parallelism, Prediction, Stage


@dataclass(frozen=True)
class Candidate:
    """One layout the search tried."""

    parallelism: Parallelism
    stages: tuple[Stage, ...]
    """Stage split and per-stage predictions; empty when pruned before a split was chosen."""
    predicted: Prediction | None
    """None when pruned by a bound."""
    fits: bool
    reason: str
    """"" for the winner, else why it lost ("OOM by 12.4 GiB on stage 0", "8% slower than the best")."""
    memory_needed_bytes: float = 0.0
    """Peak memory per GPU of the assignment shown (the leanest when none fits; a lower bound when
    pruned)."""
    tensor_parallel_plan: dict[str, str] = field(default_factory=dict)
    """Plan.tensor_parallel_plan: Linear FQN -> "colwise" | "rowwise" when tp > 1."""
    activation_checkpoint_modules: tuple[str, ...] = ()
    """Plan.activation_checkpoint_modules: every module recomputed (empty when none is)."""
    assignment: Assignment | None = None
    """The stage split and recompute per module behind `stages`."""
    compile: bool = False
    """Priced with the modules under torch.compile (Plan.compile.enable)."""


def build_problem(ctx: Context, par: Parallelism, modes: tuple[str, ...]) -> ChainProblem:
    pp, v, m = par.pp, par.virtual_stages, par.microbatches
    inputs, shared = _layout_memory(ctx, par)
    stages = pp * v
    received = 1 if pp > 1 else 0  # the gradient received for the backward running (StageMemoryModel.received)
    models = tuple(shared.stage(s, microbatches_in_flight(par.schedule, pp, m, s, v), received)
                   for s in range(stages))
    table = ctx.table(par)
    overhead = ()
    if stages > 1:
        link = ctx.groups(par).pipeline.link
        typical = sorted(inputs.cut_bytes)[len(inputs.cut_bytes) // 2]
        send = ctx.send_s(typical, par, link)
        host = ctx.cluster.gpu.pipeline_microbatch_overhead_s
        overhead = tuple(send * ((s > 0) + (s < stages - 1)) + host for s in range(stages))
    return ChainProblem(
        module_time_s={k: table.time_s(k) for k in modes},
        memory=models,
        memory_cap_bytes=ctx.cluster.usable_memory_bytes,
        pp=pp,
        modes=modes,
        stage_overhead_s=overhead,
        signature=ctx.costs.signature,
        placement=par.placement,
    )


def _layout_memory(ctx: Context, par: Parallelism) -> tuple[MemoryInputs, LayoutMemory]:
    """The memory inputs of `par` and the per-module vectors its stages share (Context's caches)."""
    autocast = ctx.autocast_layout(par)
    inputs = ctx.memory_inputs(par, autocast)
    return inputs, ctx.layout_memory(inputs, memory_layout(par, autocast))


def memory_lower_bound(ctx: Context, par: Parallelism, modes: tuple[str, ...]) -> float:
    """build_problem(ctx, par, modes).memory_lower_bound() without building the problem: its stages share their
    vectors, so its leanest stage (ChainProblem.leanest_stages) is the first keeping the fewest micro-batches, and
    the bound is remembered per those vectors, that count, the ranks and the modes (the search asks for it for
    every variant, most of which share it: a big mixture of experts prunes tens of thousands by it)."""
    pp, v = par.pp, par.virtual_stages
    _, shared = _layout_memory(ctx, par)
    n = len(ctx.chain)
    if pp * v == 1:
        key = (id(shared), 1, microbatches_in_flight(par.schedule, pp, par.microbatches, 0, v), 0, modes)
        if key not in ctx.memory_bounds:
            ctx.memory_bounds[key] = single_stage_memory(shared.stage(0, key[2], 0), modes, n)
        return ctx.memory_bounds[key]
    in_flight = fewest_in_flight(par.schedule, pp, par.microbatches, v)
    key = (id(shared), pp, in_flight, 1, modes)
    if key not in ctx.memory_bounds:
        ctx.memory_bounds[key] = problem_memory_lower_bound([shared.stage(0, in_flight, 1)], pp, modes, n)
    return ctx.memory_bounds[key]


@lru_cache(maxsize=None)
def fewest_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> int:
    """The fewest micro-batches any stage of the schedule keeps (microbatches_in_flight over its stages)."""
    return min(microbatches_in_flight(schedule, pp, microbatches, s, virtual_stages)
               for s in range(pp * virtual_stages))


def evaluate(ctx: Context, par: Parallelism, problem: ChainProblem, assignment: Assignment, fits: bool,
             reason: str = "") -> Candidate:
    """Predictions for `par` with `assignment` (memory models and module times from `problem`)."""
    pp, tp = par.pp, par.tp
    m, microbatch = par.microbatches, par.microbatch
    cp, ep = par.cp, par.ep
    table = ctx.table(par)
    chain, gpu = ctx.chain, ctx.cluster.gpu
    groups = ctx.groups(par)
    element = bytes_per_element(ctx.dtype)
    own, tied = ctx.module_numel(tp, ep), ctx.group_numel(tp)
    expert_compute = ctx.expert_compute_s(par) if ctx.experts else None
    # with ep = 1 the experts are parameters like the others (in their module's FSDP2 unit or DDP bucket)
    experts = ctx.module_expert_numel(ep) if ep > 1 else [0.0] * len(own)
    expert_shard = expert_shard_degree(par.fsdp_shard, ep, par.tp)
    cut_scale = 1.0 if ctx.autocast_layout(par) else ctx.scale  # autocast sends the fp32 residual stream
    cut = [c * microbatch * cut_scale for c in ctx.rank_cut_bytes(cp)]
    n, ranges, modes = len(chain), assignment.split.ranges(), assignment.modes
    parts: list[dict[str, float]] = []
    costs: list[StageCost] = []
    per_step, optimizer = [0.0] * pp, [0.0] * pp
    # torch.distributed.pipelining's host time per stage and micro-batch (half in each pass), and its
    # stages' compute running slower than alone
    host = gpu.pipeline_microbatch_overhead_s if pp > 1 else 0.0
    slowdown = gpu.pipeline_compute_slowdown if pp > 1 else 0.0
    for s, (a, b) in enumerate(ranges):
        modules = range(a, b)
        forward = sum(table.forward_s[u] for u in modules)
        backward = sum(table.backward_s[u] for u in modules)
        tp_forward = sum(table.tp_forward_s[u] for u in modules)
        tp_backward = sum(table.tp_backward_s[u] for u in modules)
        recompute = sum(_recompute(table, u, modes[u]) for u in modules)
        parallel_forward = sum(table.parallel_forward_s(u) for u in modules)
        parallel_backward = sum(table.parallel_backward_s(u) for u in modules)
        numels = [own[u] for u in modules]
        expert_numels = [experts[u] for u in modules]
        for g, group in enumerate(chain.tied_groups):
            held = [u for u in group.modules if a <= u < b]
            if held:
                numels[held[0] - a] += tied[g]
        held = {p for u in modules for p in chain.modules[u].parameters}
        expert_bytes = [e * element for e in expert_numels]
        share = StageShare(module_bytes=[(x - e) * element for x, e in zip(numels, expert_numels)],
                           expert_bytes=expert_bytes if par.fsdp_enabled else [], tensors=len(held), forward_s=forward,
                           backward_s=backward + recompute)
        dpc = _data_parallel(ctx, par, groups, share)
        if any(expert_numels) and not par.fsdp_enabled:  # beside DDP: the experts' gradients, over their replicas
            dpc = _sum(dpc, comm.ddp_comm(sum(expert_bytes) * calibration.GRADIENT_REDUCE_BYTES / ctx.dtype_bytes,
                                          groups.expert_replicate, share.backward_s * ctx.cluster.gpu.comm_overlap))
        expert = min(forward + backward, sum(expert_compute[u] for u in modules)) if expert_compute else 0.0
        part = {"compute": forward + backward - expert, "recompute": recompute,
                "tensor_parallel_comm": tp_forward + tp_backward, "data_parallel_comm": dpc.per_microbatch_s,
                "pipeline_comm": host + slowdown * (forward + backward + recompute)}
        if expert_compute is not None:
            part["expert_compute"] = expert
        if cp > 1:
            part["context_parallel_comm"] = sum(table.cp_forward_s[u] + table.cp_backward_s[u] for u in modules)
        if ep > 1:
            part["expert_parallel_comm"] = sum(table.ep_forward_s[u] + table.ep_backward_s[u] for u in modules)
        parts.append(part)
        send = ctx.send_s(cut[b - 1], par, groups.pipeline.link) if b < n and pp > 1 else 0.0
        weight = sum(table.backward_s[u] * ctx.costs.modules[u].weight_gradient_share for u in modules)
        costs.append(StageCost((1 + slowdown) * forward + tp_forward + parallel_forward + dpc.forward_s + host / 2,
                               (1 + slowdown) * (backward + recompute) + tp_backward + parallel_backward
                               + dpc.per_microbatch_s - dpc.forward_s + host / 2,
                               send, weight_s=(1 + slowdown) * weight))
        rank = par.stage_rank(s)
        per_step[rank] += dpc.per_step_s
        if tp > 1 and par.sp:
            per_step[rank] += sequence_local_gradient_sum_s(
                [ctx.sequence_local_numel[u] - (ctx.expert_numel[u] if ep > 1 else 0.0) for u in modules], element,
                par.fsdp_shard,
                groups.tp)
        updated = (sum(numels) - sum(expert_numels)) / par.fsdp_shard + sum(expert_numels) / expert_shard
        # FSDP2 parameters are DTensors (also over tensor-parallel replicas: runtime/distributed/parallel.py); without
        # it, only the tensor-parallel Linears' weights and biases are
        if par.fsdp_enabled or (tp > 1 and par.dp > 1):
            dtensors = len(held)
        elif tp > 1:
            dtensors = sum(1 for p in held if p.rpartition(".")[0] in ctx.facts.plan)
        else:
            dtensors = 0
        implementation = ctx.training.optimizer_implementation
        if par.offload:  # FSDP2 CPUOffloadPolicy: AdamW steps the host's shards on the CPU
            optimizer[rank] += host_optimizer_step_time(updated, ctx.cluster.hardware.host, ranks_per_node(ctx, par),
                                                        len(held), implementation)
        else:
            optimizer[rank] += optimizer_step_time(updated, gpu, len(held), dtensors, implementation)
    slots = [{k: sum(parts[s][k] for s in problem.stages_of_rank(r)) for k in parts[0]} for r in range(pp)]
    slowest = max(range(pp), key=lambda r: sum(slots[r].values()))
    breakdown = {k: m * x for k, x in slots[slowest].items()}
    busy = sum(breakdown.values())
    if pp > 1:  # the simulated schedule, with and without the transfers between stages
        schedule = par.schedule
        pipeline = simulated_step_s(schedule, pp, m, costs)
        idle = simulated_step_s(schedule, pp, m, [replace(c, send_s=0.0) for c in costs])
        breakdown["pipeline_comm"] += pipeline - idle
        breakdown["bubble"] = idle - busy
    else:
        breakdown["bubble"] = 0.0
    breakdown["data_parallel_comm"] += max(per_step)
    breakdown["pipeline_comm"] += _tied_gradient_sync(chain, assignment, par, tied, element, groups.pipeline)
    breakdown["optimizer"] = max(optimizer)
    breakdown["loss_all_reduce"] = _loss_all_reduce(ctx, par)
    if ctx.batch_statistics and par.dp > 1:
        breakdown["batch_norm_sync"] = m * _batch_norm_sync(ctx, par)
    step = sum(breakdown.values())
    stages = []
    rank_memory = [problem.rank_breakdown(r, assignment) for r in range(pp)]
    for s, (a, b) in enumerate(ranges):
        memory = rank_memory[par.stage_rank(s)]
        stages.append(Stage(index=s, modules=chain.fqns[a:b], predicted_time_s=sum(parts[s].values()),
                            predicted_memory_bytes=sum(memory.values()), memory_breakdown=dict(memory),
                            predicted_forward_s=costs[s].forward_s, predicted_send_s=costs[s].send_s,
                            predicted_weight_s=costs[s].weight_s))
    peak = max(stages, key=lambda st: st.predicted_memory_bytes)
    without_sp = None
    if tp > 1 and par.sp:  # the same layout's activations with sp=off, for the report
        plain = build_problem(ctx, replace(par, sp=False), problem.modes)
        without_sp = plain.rank_breakdown(par.stage_rank(peak.index), assignment).get("activations")
    flops = model_flops_per_step(chain, ctx.training.global_batch_size)
    tokens = ctx.training.tokens_per_sample or chain.tokens_per_sample
    batch = ctx.training.global_batch_size
    predicted = Prediction(
        step_time_s=step, samples_per_s=batch / step, tokens_per_s=batch * tokens / step if tokens else None,
        model_flops_per_step=flops, mfu=mfu(flops, step, par.world_size, gpu, ctx.dtype),
        peak_memory_bytes=peak.predicted_memory_bytes, memory_breakdown=dict(peak.memory_breakdown),
        time_breakdown=breakdown, activations_without_sequence_parallel_bytes=without_sp,
        host_memory_per_node_bytes=offload_host_bytes(ctx, par) if par.offload else 0.0)
    recomputed = tuple(chain.fqns[u] for u in range(n) if modes[u] != "none")
    mode = next((k for k in modes if k != "none"), "none")
    final = replace(par, recompute=mode)
    return Candidate(parallelism=final, stages=tuple(stages), predicted=predicted, fits=fits, reason=reason,
                     memory_needed_bytes=peak.predicted_memory_bytes,
                     tensor_parallel_plan=dict(ctx.facts.plan) if tp > 1 else {},
                     activation_checkpoint_modules=recomputed, assignment=assignment, compile=ctx.compiled)


def with_memory_without_cp_ep(ctx: Context, candidate: Candidate, modes: tuple[str, ...]) -> Candidate:
    """`candidate` with Prediction.peak_memory_without_context_parallel_bytes and ..._expert_parallel_bytes: its
    most loaded rank's memory with the same split and cp (or ep) set back to 1, for the report (computed for the
    chosen layout only: the search never needs it)."""
    par, predicted = candidate.parallelism, candidate.predicted
    if predicted is None or candidate.assignment is None:
        return candidate
    rank = par.stage_rank(max(candidate.stages, key=lambda st: st.predicted_memory_bytes).index)

    def peak(changed: Parallelism) -> float:
        return sum(build_problem(ctx, changed, modes).rank_breakdown(rank, candidate.assignment).values())

    if par.cp > 1:
        predicted = replace(predicted, peak_memory_without_context_parallel_bytes=peak(
            replace(par, cp=1)))
    if par.ep > 1:
        predicted = replace(predicted, peak_memory_without_expert_parallel_bytes=peak(
            replace(par, ep=1)))
    return replace(candidate, predicted=predicted)


def ranks_per_node(ctx: Context, par: Parallelism) -> int:
    """Ranks of a layout that share one node (and its host)."""
    return min(ctx.cluster.gpus_per_node, par.world_size)


def offload_host_bytes(ctx: Context, par: Parallelism) -> float:
    """Host memory per node that CPU offload fills: every rank's shard of its parameters' states."""
    return host_state_bytes(ctx.total_numel(par.tp, par.ep)
                            / par.pp, par.fsdp_shard, ranks_per_node(ctx, par))


def host_oom_reason(ctx: Context, par: Parallelism) -> str:
    """"" when CPU offload's host memory fits the node, else why not."""
    need, have = offload_host_bytes(ctx, par), ctx.cluster.host_memory_bytes
    if not par.offload or need <= have:
        return ""
    return f"host memory: CPU offload needs {gib(need)} GiB per node, has {gib(have)} GiB"


LOSS_BYTES = 4
"""The step's mean loss: one fp32 scalar."""


def _loss_all_reduce(ctx: Context, par: Parallelism) -> float:
    """The generated train.py all-reduces each step's loss over every rank (runtime.global_mean_loss) to
    log the global-batch mean: one scalar, so the link's latency, and a point where every rank waits."""
    world = ctx.group(par.world_size, 1)
    return comm.all_reduce_s(LOSS_BYTES, world.size, world.link, world.nodes)


def _batch_norm_sync(ctx: Context, par: Parallelism) -> float:
    """SyncBatchNorm's all-reduces of one micro-batch over all data-parallel ranks (replicate x shard,
    stride tp), seconds."""
    group = ctx.group(par.dp, par.tp)
    return comm.sync_batch_norm_s([call.channels for call in ctx.batch_statistics], group)


def _recompute(table: ModuleTable, u: int, mode: str) -> float:
    if mode == "selective":  # the ops it does not keep and the experts' route (its all-to-alls' outputs kept)
        return table.selective_recompute_s(u)
    if mode == "full":  # the whole forward again: its ring sends and all-to-alls too
        return table.forward_s[u] + table.tp_forward_s[u] + table.parallel_forward_s(u)
    return 0.0


def _sum(a: comm.DataParallelComm, b: comm.DataParallelComm) -> comm.DataParallelComm:
    return comm.DataParallelComm(a.per_microbatch_s + b.per_microbatch_s, a.per_step_s + b.per_step_s,
                                 a.total_s + b.total_s, a.forward_s + b.forward_s)


def sequence_local_gradient_sum_s(numels: list[float], element: int, shard: int, tp: comm.Group) -> float:
    """After backward, the gradients of the replicated parameters that modules run on each tp rank's sequence shard
    read (a mixture of experts' router, and its experts at ep = 1) hold this rank's tokens' share: they are
    all-reduced over the tp ranks (runtime/distributed/tensor_parallel.py reduce_partial_gradients), each rank its FSDP shard
    (1/`shard` of them), nothing hiding it. Seconds per step."""
    nbytes = sum(numels) * element / shard
    return comm.all_reduce_s(nbytes, tp.size, tp.link, tp.nodes) if nbytes > 0 else 0.0


def _split_backward(par: Parallelism) -> bool:
    """A zero-bubble schedule: the backward split into input- and weight-gradient passes (autoplan.layout)."""
    facts = SCHEDULE_BY_NAME.get(par.schedule)
    return par.pp > 1 and facts is not None and facts.split_backward


@dataclass(frozen=True)
class StageShare:
    """What one rank of a stage holds and computes, as its data-parallel communication reads it."""

    module_bytes: list[float]
    """Parameter bytes of each module (training dtype), its experts' not included."""
    expert_bytes: list[float]
    """Under FSDP: each module's experts' parameter bytes (their own unit); [] beside DDP."""
    tensors: int
    """Parameter tensors."""
    forward_s: float
    """One micro-batch's forward compute, seconds."""
    backward_s: float
    """One micro-batch's backward compute (recompute included), seconds."""


def _data_parallel(ctx: Context, par: Parallelism, groups: Groups, share: StageShare) -> comm.DataParallelComm:
    """Data-parallel communication of one rank of a stage whose modules hold share.module_bytes of parameters
    (training dtype), FSDP-sharded over groups.shard (when par.fsdp_enabled) and replicated over groups.replicate, and
    under FSDP share.expert_bytes of experts, sharded over groups.expert_shard and replicated over
    groups.expert_replicate (comm.FsdpStage), behind one micro-batch's forward and backward compute."""
    module_bytes, expert_bytes = share.module_bytes, share.expert_bytes
    sharded, shard, replicate = par.fsdp_enabled, groups.shard, groups.replicate
    gradient_ratio = calibration.GRADIENT_REDUCE_BYTES / ctx.dtype_bytes
    gpu = ctx.cluster.gpu
    # what compute can hide; FSDP2 on a CPU device has no side streams: its all-gathers and
    # reduce-scatters block the compute thread (unshard(async_op=False) waits at once), so none
    overlap = 0.0 if sharded and gpu.name == "cpu" else gpu.comm_overlap
    forward, backward = share.forward_s * overlap, share.backward_s * overlap
    streaming = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    if not sharded:
        # DDP proper only without tensor parallelism (with it, fully_shard replicates: runtime/distributed/parallel.py)
        if _split_backward(par):  # reduced after the stage's last weight pass, nothing beside it
            if par.tp == 1:  # in buckets by the stage itself, no DDP
                return comm.bucketed_all_reduce_comm(sum(module_bytes) * gradient_ratio, replicate, streaming)
            backward = 0.0  # FSDP2's replication beside tensor parallelism
        hooks = gpu.ddp_tensor_overhead_s if par.tp == 1 else 0.0
        return comm.ddp_comm(sum(module_bytes) * gradient_ratio, replicate, backward, share.tensors, hooks)
    return comm.fsdp_comm(comm.FsdpStage(
        module_param_bytes=tuple(module_bytes), reshards_after_forward=par.reshards_after_forward, shard=shard,
        replicate=replicate, pipelined=par.pp > 1,
        microbatches=par.microbatches, forward_window_s=forward,
        backward_window_s=backward, copy_bytes_per_s=streaming, gradient_ratio=gradient_ratio,
        unit_overhead_s=gpu.fsdp_unit_overhead_s,
        host_link_bytes_per_s=ctx.cluster.hardware.host.link_bandwidth_bytes_per_s if par.offload else 0.0,
        expert_param_bytes=tuple(expert_bytes), expert_shard=groups.expert_shard,
        expert_replicate=groups.expert_replicate))


def _tied_gradient_sync(chain, assignment: Assignment, par: Parallelism, tied: list[float], element: int,
                        group: comm.Group) -> float:
    """Ranks holding copies of one tied parameter all-reduce its gradient once per step."""
    stage_of = {u: par.stage_rank(s) for s, (a, b) in enumerate(assignment.split.ranges()) for u in range(a, b)}
    total = 0.0
    for g, numel in zip(chain.tied_groups, tied):
        holders = len({stage_of[u] for u in g.modules})
        total += comm.all_reduce_s(numel * element, holders, group.link, group.nodes)
    return total


def oom_reason(candidate: Candidate, cap_bytes: float) -> str:
    worst = max(candidate.stages, key=lambda st: st.predicted_memory_bytes)
    return f"OOM by {gib(worst.predicted_memory_bytes - cap_bytes)} GiB on stage {worst.index}"
