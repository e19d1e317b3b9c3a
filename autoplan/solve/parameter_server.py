"""The parameter-server layout of the planned model, priced beside the search's layouts to show why autoplan
never picks one (candidates.csv's gradient_sync=parameter_server row and the report's "why not" section).

The layout: synchronous data parallelism over every GPU, N workers each holding the whole model and a 1/N
share of the global batch in one micro-batch without recompute (the textbook parameter server), and
S = SERVERS_PER_NODE x nodes server shards, each behind one link of the cluster's kind (the inter-node link of
one GPU, or the node's own link when the job fits in one node), holding 1/S of the fp32 weights and AdamW state
in host memory. Per step (cost/parameter_server.py for push and pull):

    step = replica compute      the same layout under DDP (cost/evaluate.py: forward, backward, loss all-reduce)
                                without its gradient all-reduce and its optimizer step
         + push                 every worker's fp32 gradients (calibration.GRADIENT_REDUCE_BYTES per parameter)
         + pull                 the updated weights in the training dtype, to every worker
         + server update        AdamW on each server's 1/S on its host's CPU (cost/compute.py)

Nothing overlaps: the workers push after the backward and pull before the next forward. Each worker keeps the
weights and gradients of the whole model (DDP's memory without the optimizer state, which the servers hold).
The reason it lost compares the push and pull with the ring all-reduce DDP runs over the same GPUs
(comm.all_reduce_s on the mesh's data-parallel group) and the step with the chosen layout's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoplan.cost import calibration, comm
from autoplan.cost.compute import host_optimizer_step_time
from autoplan.cost.context import Context, gib
from autoplan.cost.evaluate import Candidate, build_problem, evaluate
from autoplan.cost.memory import HOST_STATE_BYTES_PER_PARAM
from autoplan.cost.parameter_server import ParameterServerCost, parameter_server_cost
from autoplan.cost.problem import Assignment, Split
from autoplan.plan import Parallelism

SERVERS_PER_NODE = 1
"""Server shards per node of workers: one server process per machine, as TensorFlow's ps tasks, MXNet's
distributed kvstore and BytePS deploy them; each serves through one link of the cluster's kind."""


@dataclass(frozen=True)
class ParameterServerLayout:
    """The parameter-server layout of the planned model and why it lost."""

    parallelism: Parallelism
    """The workers' layout: data parallel over every GPU (dp_replicate = workers), one micro-batch."""
    compile: bool
    """The workers' modules priced under torch.compile (as the search's layouts)."""
    workers: int
    """GPUs, each a worker with the whole model."""
    servers: int
    """Server shards (SERVERS_PER_NODE x nodes)."""
    link_bytes_per_s: float
    """Bandwidth of one server's link and of one worker's link (the cluster's link of its kind), bytes/s."""
    gradient_bytes: float
    """What a worker pushes per step: every gradient in fp32, bytes."""
    parameter_bytes: float
    """What a worker pulls per step: every weight in the training dtype, bytes."""
    sync: ParameterServerCost
    """The push and the pull, seconds, with their arithmetic."""
    server_update_s: float
    """AdamW over one server's shard on its host's CPU, seconds."""
    compute_s: float
    """The workers' part of a step: the replica's step under DDP without its all-reduce and optimizer step."""
    ring_all_reduce_s: float
    """The same gradients all-reduced over the same GPUs (what DDP runs), seconds, whole (nothing hidden)."""
    step_time_s: float
    """compute_s + push + pull + server_update_s."""
    samples_per_s: float
    peak_memory_bytes: float
    """Per worker GPU: the model's weights, gradients, activations and working memory."""
    host_memory_per_node_bytes: float
    """Host memory the servers of one node fill: SERVERS_PER_NODE shards of the fp32 weights, gradients and
    AdamW moments (memory.HOST_STATE_BYTES_PER_PARAM per parameter)."""
    fits: bool
    """The workers' memory fits the GPUs."""
    reason: str
    """Why it lost, with the arithmetic."""


def parameter_server_layout(ctx: Context, best: Candidate) -> ParameterServerLayout | None:
    """The parameter-server layout priced on ctx's cluster, compared with `best` (the chosen layout); None when
    there is nothing to synchronize (one GPU, no parameters) or the global batch does not split evenly over the
    GPUs."""
    cluster, batch = ctx.cluster, ctx.training.global_batch_size
    workers, numel = cluster.num_gpus, ctx.total_numel(1)
    if workers < 2 or batch % workers or numel <= 0:
        return None
    par = Parallelism(dp_replicate=workers, microbatch=batch // workers)
    modules = len(ctx.chain)
    problem = build_problem(ctx, par, ("none",))
    assignment = Assignment(Split((0, modules)), ("none",) * modules)
    replica = evaluate(ctx, par, problem, assignment, fits=True).predicted
    replaced = replica.time_breakdown["data_parallel_comm"] + replica.time_breakdown["optimizer"]
    compute = replica.step_time_s - replaced

    servers = SERVERS_PER_NODE * cluster.num_nodes
    link = cluster.link_for(workers).alpha_beta("p2p")
    gradient_bytes = numel * calibration.GRADIENT_REDUCE_BYTES
    parameter_bytes = numel * ctx.dtype_bytes
    sync = parameter_server_cost(gradient_bytes, parameter_bytes, workers, servers, link, link)
    update = host_optimizer_step_time(numel / servers, cluster.hardware.host, 1, 0,
                                      ctx.training.optimizer_implementation)
    group = ctx.group(workers, 1)  # DDP's data-parallel group over every GPU
    ring = comm.all_reduce_s(gradient_bytes, group.size, group.link, group.nodes)
    step = compute + sync.step_s + update
    memory = {k: v for k, v in replica.memory_breakdown.items() if k != "optimizer"}
    peak = sum(memory.values())
    host = HOST_STATE_BYTES_PER_PARAM * numel / servers * SERVERS_PER_NODE
    layout = ParameterServerLayout(
        parallelism=par, compile=ctx.compiled, workers=workers, servers=servers,
        link_bytes_per_s=link.bus_bandwidth_bytes_per_s, gradient_bytes=gradient_bytes,
        parameter_bytes=parameter_bytes, sync=sync, server_update_s=update, compute_s=compute,
        ring_all_reduce_s=ring, step_time_s=step, samples_per_s=batch / step, peak_memory_bytes=peak,
        host_memory_per_node_bytes=host, fits=peak <= cluster.usable_memory_bytes, reason="")
    return _with_reason(layout, best, cluster.usable_memory_bytes)


def _with_reason(ps: ParameterServerLayout, best: Candidate, usable_bytes: float) -> ParameterServerLayout:
    """The layout with why it lost: its synchronization against the ring all-reduce, its step against the
    chosen layout's, and its memory when it does not fit."""
    chosen = best.predicted.step_time_s
    sync = ps.sync.step_s
    shards = f"{ps.servers} server shard{'s' if ps.servers > 1 else ''}"
    parts = [f"parameter server, {ps.workers} workers and {shards} "
             f"({SERVERS_PER_NODE} per node, {ps.link_bytes_per_s / 1e9:.3g} GB/s each): {ps.sync.arithmetic}; "
             f"{sync:.3g} s of synchronization vs {ps.ring_all_reduce_s:.3g} s for a ring all-reduce of the same "
             f"gradients over the {ps.workers} GPUs ({sync / ps.ring_all_reduce_s:.3g}x, {ps.sync.bottleneck} "
             f"bound)"]
    if ps.step_time_s > chosen:
        parts.append(f"step {ps.step_time_s:.3g} s = {ps.compute_s:.3g} s compute + {sync:.3g} s push and pull + "
                     f"{ps.server_update_s:.3g} s AdamW on the servers, {ps.step_time_s / chosen:.3g}x the chosen "
                     f"layout's {chosen:.3g} s")
    else:
        parts.append(f"step {ps.step_time_s:.3g} s, not slower than the chosen layout's {chosen:.3g} s, but autoplan "
                     "generates PyTorch's collectives only (no parameter-server runtime)")
    if not ps.fits:
        parts.append(f"does not fit: every worker holds the whole model's weights and gradients, "
                     f"{gib(ps.peak_memory_bytes)} GiB per GPU, has {gib(usable_bytes)} GiB")
    return replace(ps, reason="; ".join(parts))
