"""Communication, alpha-beta: time = alpha + bytes x bus factor / bus bandwidth.

Bus factors (nccl-tests PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather and reduce-scatter
(n-1)/n of the full (unsharded) size; a point-to-point send moves its bytes once. alpha is
Link.latency_s (nccl-tests small-message latency of one node's collective), times log2 of the nodes
a group spans when it leaves the node (NCCL's tree latency grows with log2(nodes); formulas.md).
Link.bus_bandwidth_bytes_per_s is the busbw of the slowest tier the group crosses. A link calibrated
per operation (Link.collectives: gloo runs each collective with its own algorithm) gives each its own
alpha and busbw.

Overlap is modelled as "everything overlaps except the piece that cannot start before the compute
ends": exposed = serial piece + max(0, rest - overlap window). The window is the compute time times
Gpu.comm_overlap (1 on GPUs; measured on a CPU, whose gloo threads share the cores).
- DDP (dp_shard 1): gradients all-reduce in DDP_BUCKET_BYTES buckets during the backward of the last
  micro-batch (earlier ones run under no_sync); all but the last bucket hide behind that backward.
  DDP also costs time per parameter tensor (Gpu.ddp_tensor_overhead_s, measured; ~0 on GPUs).
- FSDP2 resharding after forward (reshard=always), pp = 1: per micro-batch, all-gather every module in
  forward and again in backward, reduce-scatter every module in backward (one collective per module);
  the first gather and the last reduce-scatter are exposed, the rest hide behind the compute of that
  pass. HSDP adds an all-reduce of the sharded gradients over the replicas, hidden like the
  reduce-scatters.
- FSDP2 without resharding after forward (reshard=never), pp = 1: per micro-batch one all-gather
  (forward) and one reduce-scatter (backward), exposed the same way.
- Any FSDP under a pipeline: parameters are gathered once per step (first micro-batch) and gradients
  reduce-scattered once after the last backward (torch.distributed.pipelining), which nothing hides. The
  zero-bubble schedules reduce-scatter after the stage's last weight-gradient pass, the same once per step.
- Replicas under a zero-bubble schedule (split backward, dp_shard 1): no DDP (its hooks would never fire in the
  autograd.grad passes); after the stage's last weight-gradient pass its gradients are copied into flat buckets of
  DDP_BUCKET_BYTES, all-reduced, averaged and copied back (runtime/distributed/split_backward.py), which nothing hides.
- Expert parallelism under FSDP2: a module's experts (E/ep per rank) are their own FSDP2 unit, sharded over the
  ranks holding the same experts (dp_shard x cp / ep; HSDP's replicas beside), gathered and reduce-scattered
  in the same streams just before the module's other parameters: their collectives add to that module's and
  hide behind the same compute (one window, not one each).
- FSDP2's hooks cost host time per module and micro-batch (Gpu.fsdp_unit_overhead_s, measured; ~0 on GPUs).
- FSDP2 also copies every gathered parameter out of the all-gather buffer and every gradient into
  the reduce-scatter buffer on the compute stream (fully_shard's copy-out / chunk-cat copy-in): each
  reads and writes the unsharded bytes once, at the device's streaming bandwidth, never hidden.
- SyncBatchNorm (a model with BatchNorm under data parallelism): every BatchNorm call all-reduces its
  per-channel sum and sum of squares and the sample count in forward (2C + 1 fp32 values) and the two
  per-channel gradient sums in backward (2C values) over the data-parallel ranks, per micro-batch. The
  next op needs the result at once, so nothing hides them: small collectives, mostly latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from autoplan.hardware.types import Link

DDP_BUCKET_BYTES = 25 * 2**20
"""torch DistributedDataParallel default bucket_cap_mb = 25 (MiB)."""
FSDP_COPY_TRAFFIC = 2
"""Bytes moved per unsharded byte by an FSDP2 copy-out or copy-in: one read plus one write."""


def alpha_s(link: Link, nodes: int = 1, op: str = "all_reduce") -> float:
    """Latency of one collective over `nodes` nodes (tree: log2 of the node count)."""
    latency = link.alpha_beta(op).latency_s
    return latency * max(1.0, math.log2(nodes)) if nodes > 1 else latency


def _collective_s(op: str, bus_bytes: float, link: Link, nodes: int) -> float:
    return alpha_s(link, nodes, op) + bus_bytes / link.alpha_beta(op).bus_bandwidth_bytes_per_s


def all_reduce_s(nbytes: float, group: int, link: Link, nodes: int = 1) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return _collective_s("all_reduce", nbytes * 2 * (group - 1) / group, link, nodes)


def all_gather_s(nbytes: float, group: int, link: Link, nodes: int = 1) -> float:
    """All-gather producing `nbytes` (the unsharded size) on every rank."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return _collective_s("all_gather", nbytes * (group - 1) / group, link, nodes)


def reduce_scatter_s(nbytes: float, group: int, link: Link, nodes: int = 1) -> float:
    """Reduce-scatter of `nbytes` (the unsharded size) per rank."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return _collective_s("reduce_scatter", nbytes * (group - 1) / group, link, nodes)


def all_to_all_s(nbytes: float, group: int, link: Link, nodes: int = 1) -> float:
    """All-to-all of `nbytes` per rank spread evenly over the group: (group-1)/group of them leave the rank."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return _collective_s("all_to_all", nbytes * (group - 1) / group, link, nodes)


def p2p_s(nbytes: float, link: Link) -> float:
    if nbytes <= 0:
        return 0.0
    return _collective_s("p2p", nbytes, link, 1)


def exposed_s(total_s: float, serial_s: float, window_s: float) -> float:
    """Time communication adds: its serial piece plus whatever of the rest the window cannot hide."""
    return serial_s + max(0.0, total_s - serial_s - window_s)


@dataclass(frozen=True)
class Group:
    """A communicator: its size, the slowest link it crosses and the nodes it spans."""

    size: int
    link: Link
    nodes: int = 1


@dataclass(frozen=True)
class DataParallelComm:
    """Data-parallel communication of one rank of a stage, seconds."""

    per_microbatch_s: float
    """Exposed time added to every micro-batch slot (FSDP parameter gathers)."""
    per_step_s: float
    """Exposed time added once per step (gradient reduction)."""
    total_s: float
    """Communication time if nothing overlapped (for reports)."""
    forward_s: float = 0.0
    """The part of per_microbatch_s spent in the forward (the rest is in the backward)."""


NO_COMM = DataParallelComm(0.0, 0.0, 0.0)


def ddp_comm(grad_bytes: float, group: Group, backward_window_s: float, tensors: int = 0,
             tensor_overhead_s: float = 0.0) -> DataParallelComm:
    """Bucketed gradient all-reduce overlapping the last micro-batch's backward, plus DDP's time per
    parameter tensor (`tensors` of them, Gpu.ddp_tensor_overhead_s each)."""
    if group.size <= 1 or grad_bytes <= 0:
        return NO_COMM
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    total = (all_reduce_s(grad_bytes, group.size, group.link, group.nodes)
             + (buckets - 1) * alpha_s(group.link, group.nodes))
    last_bucket = all_reduce_s(min(grad_bytes, DDP_BUCKET_BYTES), group.size, group.link, group.nodes)
    hooks = tensors * tensor_overhead_s
    return DataParallelComm(0.0, exposed_s(total, last_bucket, backward_window_s) + hooks, total)


FLAT_COPY_TRAFFIC = 6
"""Bytes read and written per gradient byte around a bucket's all-reduce: concatenating into the bucket, averaging
it, copying back (each reads and writes every byte)."""


def bucketed_all_reduce_comm(grad_bytes: float, group: Group, copy_bytes_per_s: float) -> DataParallelComm:
    """The all-reduce of a stage's `grad_bytes` of gradients in buckets of DDP_BUCKET_BYTES after its last
    weight-gradient pass (a zero-bubble schedule's replicas), plus the copies in and out of the buckets at
    `copy_bytes_per_s`; nothing hides it."""
    if group.size <= 1 or grad_bytes <= 0:
        return NO_COMM
    reduce = ddp_comm(grad_bytes, group, backward_window_s=0.0)
    return DataParallelComm(0.0, reduce.per_step_s + FLAT_COPY_TRAFFIC * grad_bytes / copy_bytes_per_s, reduce.total_s)


@dataclass(frozen=True)
class FsdpStage:
    """What FSDP2's collectives on one rank of a stage depend on."""

    module_param_bytes: tuple[float, ...]
    """Parameter bytes of each module of the stage (FSDP2 shards each as one unit), training dtype, unsharded."""
    reshards_after_forward: bool
    """Gathered again for backward (ZeRO-3) or kept from forward (ZeRO-1/2)."""
    shard: Group
    replicate: Group
    """HSDP's replicas (size 1 without HSDP): they all-reduce the sharded gradients."""
    pipelined: bool
    """Under torch.distributed.pipelining (pp > 1): gathered once per step, reduced after the last backward."""
    microbatches: int
    forward_window_s: float
    """One micro-batch's forward compute that communication can hide behind, seconds."""
    backward_window_s: float
    copy_bytes_per_s: float
    """The device's achievable streaming bandwidth (FSDP2's copy-in and copy-out)."""
    gradient_ratio: float = 1.0
    """Gradient bytes reduced per parameter byte (2 for bf16 parameters reduced in fp32)."""
    unit_overhead_s: float = 0.0
    """Host time FSDP2 adds per module and micro-batch (Gpu.fsdp_unit_overhead_s)."""
    host_link_bytes_per_s: float = 0.0
    """CPU offload: the host-device link (Host.link_bandwidth_bytes_per_s) each unit's fp32 parameter shard
    crosses before its all-gather and its fp32 gradient shard after its reduce-scatter, in the collectives'
    stream (so hidden behind compute like them); 0 without offload."""
    expert_param_bytes: tuple[float, ...] = ()
    """Expert parallelism: of each module, its experts' parameter bytes (E/ep experts, training dtype, unsharded),
    not in module_param_bytes: their own FSDP2 unit over `expert_shard`, with `expert_replicate` beside; ()
    without experts."""
    expert_shard: Group | None = None
    """The ranks sharing the experts' states (dp_shard x cp / ep; size 1 when ep takes them all)."""
    expert_replicate: Group | None = None
    """The ranks holding the same experts' shard, which all-reduce its gradients (HSDP's replicas)."""


def _gathers(module_bytes: Sequence[float], shard: Group) -> list[float]:
    """One all-gather over `shard` per module of `module_bytes` (unsharded)."""
    return [all_gather_s(b, shard.size, shard.link, shard.nodes) for b in module_bytes]


def _scatters(module_bytes: Sequence[float], gradient_ratio: float, shard: Group, replicate: Group) -> list[float]:
    """Per module: the reduce-scatter of its gradients over `shard`, then HSDP's all-reduce of the shard over
    `replicate`."""
    grads = [b * gradient_ratio for b in module_bytes]
    return [reduce_scatter_s(g, shard.size, shard.link, shard.nodes)
            + all_reduce_s(g / shard.size, replicate.size, replicate.link, replicate.nodes) for g in grads]


def fsdp_comm(stage: FsdpStage) -> DataParallelComm:
    """FSDP2 collectives of one rank of a stage (see the module docstring)."""
    module_bytes = stage.module_param_bytes
    experts = stage.expert_param_bytes or tuple(0.0 for _ in module_bytes)
    stage_bytes = sum(module_bytes) + sum(experts)
    shard, replicate = stage.shard, stage.replicate
    if shard.size <= 1 or stage_bytes <= 0:
        return NO_COMM
    # the experts are a unit of their own inside a module holding other parameters (a chain module that is the
    # experts module is that one unit)
    units = len(module_bytes) + sum(1 for b, e in zip(module_bytes, experts) if b > 0 and e > 0)
    hooks = units * stage.unit_overhead_s
    copy_s = FSDP_COPY_TRAFFIC * stage_bytes / stage.copy_bytes_per_s
    gathers = _gathers(module_bytes, shard)
    scatters = _scatters(module_bytes, stage.gradient_ratio, shard, replicate)
    shard_bytes = [b / shard.size for b in module_bytes]  # what a rank keeps of each module
    if any(experts):
        expert_shard, expert_replicate = stage.expert_shard, stage.expert_replicate
        if expert_shard is None or expert_replicate is None:
            raise ValueError("FsdpStage: expert_param_bytes needs expert_shard and expert_replicate")
        gathers = [g + e for g, e in zip(gathers, _gathers(experts, expert_shard))]
        scatters = [r + e for r, e in zip(scatters, _scatters(experts, stage.gradient_ratio, expert_shard,
                                                              expert_replicate))]
        shard_bytes = [b + e / expert_shard.size for b, e in zip(shard_bytes, experts)]
    if stage.host_link_bytes_per_s > 0:  # CPU offload: fp32 shards in before each gather, gradients out after
        host = stage.host_link_bytes_per_s
        gathers = [g + b * stage.gradient_ratio / host for g, b in zip(gathers, shard_bytes)]
        scatters = [r + b * stage.gradient_ratio / host for r, b in zip(scatters, shard_bytes)]
    if stage.pipelined:  # gathered once per step, reduced once after the last backward
        first = exposed_s(sum(gathers), gathers[0], stage.forward_window_s) + copy_s
        return DataParallelComm(hooks, first + sum(scatters) + copy_s, sum(gathers) + sum(scatters), hooks / 2)
    forward = exposed_s(sum(gathers), gathers[0], stage.forward_window_s) + copy_s
    m = stage.microbatches
    if stage.reshards_after_forward:
        backward = exposed_s(sum(gathers) + sum(scatters), scatters[-1], stage.backward_window_s) + 2 * copy_s
        total = m * (2 * sum(gathers) + sum(scatters))
    else:
        backward = exposed_s(sum(scatters), scatters[-1], stage.backward_window_s) + copy_s
        total = m * (sum(gathers) + sum(scatters))
    return DataParallelComm(forward + backward + hooks, 0.0, total, forward + hooks / 2)


SYNC_STATISTICS_BYTES = 4
"""Bytes per synchronized BatchNorm statistic: fp32 (runtime/distributed/batchnorm.py reduces in fp32)."""


def sync_batch_norm_s(channels: Sequence[int], group: Group) -> float:
    """Exposed seconds of SyncBatchNorm's all-reduces for one micro-batch's forward and backward, one
    BatchNorm call per entry of `channels` (its channel count C)."""
    if group.size <= 1:
        return 0.0
    total = 0.0
    for c in channels:
        forward = all_reduce_s((2 * c + 1) * SYNC_STATISTICS_BYTES, group.size, group.link, group.nodes)
        backward = all_reduce_s(2 * c * SYNC_STATISTICS_BYTES, group.size, group.link, group.nodes)
        total += forward + backward
    return total
