"""Price one layout with one assignment (stage split + recompute per unit): time, memory, MFU.

Step time (seconds), p pipeline ranks with v stages each, m micro-batches, q the slowest rank:

    slot_q  = sum over q's stages of (compute + recompute + tensor-parallel collectives
              + exposed FSDP gathers per micro-batch + the pipelining runtime's host time)
    step    = the pipeline schedule simulated with each stage's forward, backward and boundary
              transfer (cost/pipeline.py; (m + (p - 1) / v) x slot_q for balanced stages and
              free transfers): m x slot_q busy, the rest bubble and exposed transfers
            + max over ranks of exposed gradient reduction (cost/comm.py)
            + all-reduce of tied parameters split over stages
            + max over ranks of the AdamW step            (cost/compute.py)
            + the all-reduce of the step's loss over every rank (train.py logs the global mean)

Mesh dims in rank order ("pp", "dp_replicate", "dp_shard", "tp"): tensor parallel groups are
contiguous (stride 1, inside a node), dp_shard has stride tp, dp_replicate stride tp x dp_shard and the
pipeline stride tp x dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autoplan.cost import calibration, comm
from autoplan.cost.compute import UnitTable, mfu, model_flops_per_step, optimizer_step_time, unit_table
from autoplan.cost.dtypes import activation_scale, bytes_per_element, training_dtype
from autoplan.cost.memory import LayoutMemory, MemoryInputs, layout_memory
from autoplan.cost.pipeline import StageCost, microbatches_in_flight, simulated_step_s
from autoplan.cost.units import chain_costs
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, Prediction, Stage, Training
from autoplan.profile.types import ModelProfile
from autoplan.solve.layers import build_chain
from autoplan.solve.problem import Assignment, ChainProblem
from autoplan.solve.tensor_parallel import tensor_parallel_facts

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as GiB for messages: one decimal, or two significant digits below 1 GiB."""
    value = nbytes / GIB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.2g}"


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
    """Plan.activation_checkpoint_modules: units recomputed; empty = all (when the mode is not none)."""
    assignment: Assignment | None = None
    """The stage split and recompute per unit behind `stages`."""


@dataclass(frozen=True)
class Groups:
    tp: comm.Group
    shard: comm.Group
    replicate: comm.Group
    pipeline: comm.Group


class Context:
    """A profile prepared for pricing layouts on a cluster; unit tables cached per (tp, micro-batch)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training, features: frozenset[str]) -> None:
        self.profile, self.cluster, self.training, self.features = profile, cluster, training, features
        self.chain = build_chain(profile)
        self.facts = tensor_parallel_facts(profile, vocab_parallel="tp_vocab_parallel" in features,
                                           fused_split="tp_fused_split" in features)
        self.costs = chain_costs(profile, self.chain, self.facts)
        self.dtype = training_dtype(training.dtype)
        self.dtype_bytes = bytes_per_element(self.dtype)
        self.scale = activation_scale(self.chain.capture_dtype, self.dtype)
        self.use_measured = self.costs.measured and cluster.gpu.name == "cpu"
        self._tables: dict[tuple[int, int], UnitTable] = {}
        self._inputs: dict[tuple[int, int], MemoryInputs] = {}
        self._layouts: dict[tuple, LayoutMemory] = {}

    def group(self, size: int, stride: int) -> comm.Group:
        """A mesh-dim communicator. Across nodes, NCCL runs one ring per NIC, so a group with k GPUs
        in each node moves k x the per-GPU inter-node bus bandwidth (capped by the node's own)."""
        span = (size - 1) * stride + 1
        per_node = self.cluster.gpus_per_node
        nodes = size if stride >= per_node else max(1, math.ceil(span / per_node))
        link = self.cluster.link_for(size, stride)
        if nodes > 1:
            local = max(1, min(size // nodes, per_node // stride)) if stride < per_node else 1
            intra = self.cluster.hardware.intra_node.bus_bandwidth_bytes_per_s
            link = link.with_bus_bandwidth(min(intra, link.bus_bandwidth_bytes_per_s * local))
        return comm.Group(size, link, min(size, nodes))

    def groups(self, par: Parallelism) -> Groups:
        t, s, r = par.tensor_parallel_degree, par.data_parallel_shard_degree, par.data_parallel_replicate_degree
        return Groups(self.group(t, 1), self.group(s, t), self.group(r, t * s),
                      self.group(par.pipeline_parallel_degree, t * s * r))

    def send_s(self, nbytes: float, par: Parallelism, link) -> float:
        """One activation (or gradient) crossing a stage boundary. Each tensor-parallel rank sends the
        whole replicated tensor (torch.distributed.pipelining), unless "pp_scatter_gather" is on:
        Megatron-LM sends 1/tp per rank and all-gathers it inside the node (Narayanan et al. SC21 4.1)."""
        tp = par.tensor_parallel_degree
        if tp == 1 or "pp_scatter_gather" not in self.features:
            return comm.p2p_s(nbytes, link)
        return comm.p2p_s(nbytes / tp, link) + comm.all_gather_s(nbytes, tp, self.group(tp, 1).link)

    def table(self, tp: int, microbatch: int) -> UnitTable:
        key = (tp, microbatch)
        if key not in self._tables:
            self._tables[key] = unit_table(self.costs, self.cluster.gpu, self.chain.capture_dtype, self.dtype, tp,
                                           microbatch, self.group(tp, 1).link, self.use_measured)
        return self._tables[key]

    def total_numel(self, tp: int) -> float:
        """Parameter elements on a tensor-parallel rank, tied ones once."""
        return sum(self.unit_numel(tp)) + sum(self.group_numel(tp))

    def unit_numel(self, tp: int) -> list[float]:
        return [u.replicated_numel + u.split_numel / tp for u in self.costs.units]

    def group_numel(self, tp: int) -> list[float]:
        return [g.numel / (tp if split else 1) for g, split in zip(self.chain.tied_groups, self.costs.tied_split)]

    def layout_memory(self, inputs: MemoryInputs, zero: int, shard: int, pp: int) -> LayoutMemory:
        key = (id(inputs), zero, shard, pp > 1)
        if key not in self._layouts:
            self._layouts[key] = layout_memory(inputs, self.dtype, zero, shard, pp)
        return self._layouts[key]

    def memory_inputs(self, tp: int, microbatch: int) -> MemoryInputs:
        key = (tp, microbatch)
        if key not in self._inputs:
            self._inputs[key] = self._memory_inputs(tp, microbatch)
        return self._inputs[key]

    def _memory_inputs(self, tp: int, microbatch: int) -> MemoryInputs:
        table = self.table(tp, microbatch)
        own, groups = self.unit_numel(tp), self.group_numel(tp)
        whole = [own[u] + sum(n for n, g in zip(groups, self.chain.tied_groups) if u in g.units)
                 for u in range(len(own))]
        return MemoryInputs(
            unit_numel=tuple(own), group_numel=tuple(groups),
            tied_group_units=tuple(g.units for g in self.chain.tied_groups),
            unit_largest_numel=tuple(whole), activations=table.activation_bytes,
            working_bytes=table.working_bytes,
            cut_bytes=tuple(c * microbatch * self.scale for c in self.chain.cut_bytes),
        )


def build_problem(ctx: Context, par: Parallelism, modes: tuple[str, ...]) -> ChainProblem:
    pp, v = par.pipeline_parallel_degree, par.pipeline_parallel_virtual_stages
    tp, mbs = par.tensor_parallel_degree, par.pipeline_parallel_microbatch_size
    m = par.pipeline_parallel_num_microbatches
    inputs = ctx.memory_inputs(tp, mbs)
    stages = pp * v
    shared = ctx.layout_memory(inputs, par.zero_stage, par.data_parallel_shard_degree, pp)
    models = tuple(shared.stage(s, microbatches_in_flight(par.pipeline_parallel_schedule, pp, m, s, v))
                   for s in range(stages))
    table = ctx.table(tp, mbs)
    overhead = ()
    if stages > 1:
        link = ctx.groups(par).pipeline.link
        typical = sorted(inputs.cut_bytes)[len(inputs.cut_bytes) // 2]
        send = ctx.send_s(typical, par, link)
        host = ctx.cluster.gpu.pipeline_microbatch_overhead_s
        overhead = tuple(send * ((s > 0) + (s < stages - 1)) + host for s in range(stages))
    return ChainProblem(
        unit_time_s={k: table.time_s(k) for k in modes},
        memory=models,
        memory_cap_bytes=ctx.cluster.usable_memory_bytes,
        num_ranks=pp,
        modes=modes,
        stage_overhead_s=overhead,
        signature=ctx.costs.signature,
    )


def evaluate(ctx: Context, par: Parallelism, problem: ChainProblem, assignment: Assignment, fits: bool,
             reason: str = "") -> Candidate:
    """Predictions for `par` with `assignment` (memory models and unit times from `problem`)."""
    pp, v, tp = par.pipeline_parallel_degree, par.pipeline_parallel_virtual_stages, par.tensor_parallel_degree
    m, mbs = par.pipeline_parallel_num_microbatches, par.pipeline_parallel_microbatch_size
    table, chain, gpu = ctx.table(tp, mbs), ctx.chain, ctx.cluster.gpu
    groups = ctx.groups(par)
    element = bytes_per_element(ctx.dtype)
    own, tied = ctx.unit_numel(tp), ctx.group_numel(tp)
    cut = [c * mbs * ctx.scale for c in chain.cut_bytes]
    n, ranges, modes = len(chain), assignment.split.ranges(), assignment.modes
    parts: list[dict[str, float]] = []
    costs: list[StageCost] = []
    per_step, optimizer = [0.0] * pp, [0.0] * pp
    # torch.distributed.pipelining's host time per stage and micro-batch (half in each pass), and its
    # stages' compute running slower than alone
    host = gpu.pipeline_microbatch_overhead_s if pp > 1 else 0.0
    slowdown = gpu.pipeline_compute_slowdown if pp > 1 else 0.0
    for s, (a, b) in enumerate(ranges):
        units = range(a, b)
        forward = sum(table.forward_s[u] for u in units)
        backward = sum(table.backward_s[u] for u in units)
        tp_forward = sum(table.tp_forward_s[u] for u in units)
        tp_backward = sum(table.tp_backward_s[u] for u in units)
        recompute = sum(_recompute(table, u, modes[u]) for u in units)
        numels = [own[u] for u in units]
        for g, group in enumerate(chain.tied_groups):
            held = [u for u in group.units if a <= u < b]
            if held:
                numels[held[0] - a] += tied[g]
        held = {p for u in units for p in chain.units[u].parameters}
        dpc = _data_parallel(par, groups, [x * element for x in numels], m, forward, backward + recompute, ctx,
                             len(held))
        parts.append({"compute": forward + backward, "recompute": recompute,
                      "tensor_parallel_comm": tp_forward + tp_backward, "data_parallel_comm": dpc.per_microbatch_s,
                      "pipeline_comm": host + slowdown * (forward + backward + recompute)})
        send = ctx.send_s(cut[b - 1], par, groups.pipeline.link) if b < n and pp > 1 else 0.0
        costs.append(StageCost((1 + slowdown) * forward + tp_forward + dpc.forward_s + host / 2,
                               (1 + slowdown) * (backward + recompute) + tp_backward + dpc.per_microbatch_s
                               - dpc.forward_s + host / 2,
                               send))
        rank = s % pp
        per_step[rank] += dpc.per_step_s
        updated = sum(numels) / (par.data_parallel_shard_degree if par.zero_stage >= 1 else 1)
        # FSDP2 parameters are DTensors (also over tensor-parallel replicas: runtime/parallel.py); without
        # it, only the tensor-parallel Linears' weights and biases are
        if par.zero_stage >= 1 or (tp > 1 and par.data_parallel_degree > 1):
            dtensors = len(held)
        elif tp > 1:
            dtensors = sum(1 for p in held if p.rpartition(".")[0] in ctx.facts.plan)
        else:
            dtensors = 0
        optimizer[rank] += optimizer_step_time(updated, gpu, len(held), dtensors)
    slots = [{k: sum(parts[s][k] for s in problem.stages_of_rank(r)) for k in parts[0]} for r in range(pp)]
    slowest = max(range(pp), key=lambda r: sum(slots[r].values()))
    breakdown = {k: m * x for k, x in slots[slowest].items()}
    busy = sum(breakdown.values())
    if pp > 1:  # the simulated schedule, with and without the transfers between stages
        schedule = par.pipeline_parallel_schedule
        pipeline = simulated_step_s(schedule, pp, m, costs)
        idle = simulated_step_s(schedule, pp, m, [replace(c, send_s=0.0) for c in costs])
        breakdown["pipeline_comm"] += pipeline - idle
        breakdown["bubble"] = idle - busy
    else:
        breakdown["bubble"] = 0.0
    breakdown["data_parallel_comm"] += max(per_step)
    breakdown["pipeline_comm"] += _tied_gradient_sync(chain, assignment, pp, tied, element, groups.pipeline)
    breakdown["optimizer"] = max(optimizer)
    breakdown["loss_all_reduce"] = _loss_all_reduce(ctx, par)
    step = sum(breakdown.values())
    stages = []
    rank_memory = [problem.rank_breakdown(r, assignment) for r in range(pp)]
    for s, (a, b) in enumerate(ranges):
        memory = rank_memory[s % pp]
        stages.append(Stage(index=s, modules=chain.fqns[a:b], predicted_time_s=sum(parts[s].values()),
                            predicted_memory_bytes=sum(memory.values()), memory_breakdown=dict(memory),
                            predicted_forward_s=costs[s].forward_s, predicted_send_s=costs[s].send_s))
    peak = max(stages, key=lambda st: st.predicted_memory_bytes)
    flops = model_flops_per_step(chain, ctx.training.global_batch_size)
    tokens = ctx.training.tokens_per_sample or chain.tokens_per_sample
    batch = ctx.training.global_batch_size
    predicted = Prediction(
        step_time_s=step, samples_per_s=batch / step, tokens_per_s=batch * tokens / step if tokens else None,
        model_flops_per_step=flops, mfu=mfu(flops, step, par.world_size, gpu, ctx.dtype),
        peak_memory_bytes=peak.predicted_memory_bytes, memory_breakdown=dict(peak.memory_breakdown),
        time_breakdown=breakdown)
    recomputed = tuple(chain.fqns[u] for u in range(n) if modes[u] != "none")
    mode = next((k for k in modes if k != "none"), "none")
    final = Parallelism(**{**par.__dict__, "activation_checkpoint": mode})
    return Candidate(final, tuple(stages), predicted, fits, reason, peak.predicted_memory_bytes,
                     dict(ctx.facts.plan) if tp > 1 else {},
                     () if len(recomputed) == n else recomputed, assignment)


LOSS_BYTES = 4
"""The step's mean loss: one fp32 scalar."""


def _loss_all_reduce(ctx: Context, par: Parallelism) -> float:
    """The generated train.py all-reduces each step's loss over every rank (runtime.global_mean_loss) to
    log the global-batch mean: one scalar, so the link's latency, and a point where every rank waits."""
    world = ctx.group(par.world_size, 1)
    return comm.all_reduce_s(LOSS_BYTES, world.size, world.link, world.nodes)


def _recompute(table: UnitTable, u: int, mode: str) -> float:
    if mode == "selective":
        return table.cheap_forward_s[u]
    if mode == "full":
        return table.forward_s[u] + table.tp_forward_s[u]
    return 0.0


def _data_parallel(par: Parallelism, groups: Groups, unit_bytes: list[float], m: int, forward: float,
                   backward: float, ctx: Context, tensors: int = 0) -> comm.DataParallelComm:
    gradient_ratio = calibration.GRADIENT_REDUCE_BYTES / ctx.dtype_bytes
    gpu = ctx.cluster.gpu
    # what compute can hide; FSDP2 on a CPU device has no side streams: its all-gathers and
    # reduce-scatters block the compute thread (unshard(async_op=False) waits at once), so none
    overlap = 0.0 if par.zero_stage >= 1 and gpu.name == "cpu" else gpu.comm_overlap
    forward, backward = forward * overlap, backward * overlap
    if par.zero_stage == 0:
        # DDP proper only without tensor parallelism (with it, fully_shard replicates: runtime/parallel.py)
        hooks = gpu.ddp_tensor_overhead_s if par.tensor_parallel_degree == 1 else 0.0
        return comm.ddp_comm(sum(unit_bytes) * gradient_ratio, groups.replicate, backward, tensors, hooks)
    streaming = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    return comm.fsdp_comm(unit_bytes, par.zero_stage, groups.shard, groups.replicate, par.pipeline_parallel_degree,
                          m, forward, backward, streaming, gradient_ratio, gpu.fsdp_unit_overhead_s)


def _tied_gradient_sync(chain, assignment: Assignment, pp: int, tied: list[float], element: int,
                        group: comm.Group) -> float:
    """Ranks holding copies of one tied parameter all-reduce its gradient once per step."""
    stage_of = {u: s % pp for s, (a, b) in enumerate(assignment.split.ranges()) for u in range(a, b)}
    total = 0.0
    for g, numel in zip(chain.tied_groups, tied):
        holders = len({stage_of[u] for u in g.units})
        total += comm.all_reduce_s(numel * element, holders, group.link, group.nodes)
    return total


def oom_reason(candidate: Candidate, cap_bytes: float) -> str:
    worst = max(candidate.stages, key=lambda st: st.predicted_memory_bytes)
    return f"OOM by {gib(worst.predicted_memory_bytes - cap_bytes)} GiB on stage {worst.index}"
