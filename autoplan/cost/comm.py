"""Communication, alpha-beta: time = latency + bytes x bus factor / bus bandwidth.

Bus factors (nccl-tests PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather and reduce-scatter
(n-1)/n of the full (unsharded) size; a point-to-point send moves its bytes once. Link.latency_s is
charged once per collective or message.

Overlap is modelled explicitly as "everything overlaps except the piece that cannot start before
the compute ends": exposed = serial piece + max(0, rest - overlap window).
- DDP (zero 0): gradients all-reduce in DDP_BUCKET_BYTES buckets during the backward of the last
  micro-batch (earlier ones run under no_sync); all but the last bucket hide behind that backward.
- FSDP (zero 3), pp = 1: per micro-batch, all-gather every unit in forward and again in backward,
  reduce-scatter every unit in backward (FSDP2 defaults, one collective per unit); the first gather
  and the last reduce-scatter are exposed, the rest hide behind the compute of that pass.
- FSDP (zero 3), pp > 1: one forward all-gather per micro-batch (exposed as above); torch pipelining
  keeps parameters gathered for backward and reduce-scatters once after the last backward
  (stage.py perform_reduce_grad), which nothing hides.
- FSDP2 also copies every gathered parameter out of the all-gather buffer and every gradient into
  the reduce-scatter buffer on the compute stream (fully_shard's copy-out / chunk-cat copy-in): each
  reads and writes the unsharded bytes once, at the device's streaming bandwidth, never hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.hardware.types import Link

DDP_BUCKET_BYTES = 25 * 2**20
"""torch DistributedDataParallel default bucket_cap_mb = 25 (MiB)."""


def all_reduce_s(nbytes: float, group: int, link: Link) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes * 2 * (group - 1) / group / link.bus_bandwidth_bytes_per_s


def all_gather_s(nbytes: float, group: int, link: Link) -> float:
    """All-gather producing `nbytes` (the unsharded size) on every rank."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes * (group - 1) / group / link.bus_bandwidth_bytes_per_s


def reduce_scatter_s(nbytes: float, group: int, link: Link) -> float:
    """Reduce-scatter of `nbytes` (the unsharded size) per rank."""
    return all_gather_s(nbytes, group, link)


def p2p_s(nbytes: float, link: Link) -> float:
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / link.bus_bandwidth_bytes_per_s


def exposed_s(total_s: float, serial_s: float, window_s: float) -> float:
    """Time communication adds: its serial piece plus whatever of the rest the window cannot hide."""
    return serial_s + max(0.0, total_s - serial_s - window_s)


@dataclass(frozen=True)
class DataParallelComm:
    """Data-parallel communication of one rank of a stage, seconds."""

    per_microbatch_s: float
    """Exposed time added to every micro-batch slot (FSDP parameter gathers)."""
    per_step_s: float
    """Exposed time added once per step (gradient reduction)."""
    total_s: float
    """Communication time if nothing overlapped (for reports)."""


NO_COMM = DataParallelComm(0.0, 0.0, 0.0)


def ddp_comm(grad_bytes: float, group: int, link: Link, backward_window_s: float) -> DataParallelComm:
    """Bucketed gradient all-reduce overlapping the last micro-batch's backward."""
    if group <= 1 or grad_bytes <= 0:
        return NO_COMM
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    total = all_reduce_s(grad_bytes, group, link) + (buckets - 1) * link.latency_s
    last_bucket = all_reduce_s(min(grad_bytes, DDP_BUCKET_BYTES), group, link)
    return DataParallelComm(0.0, exposed_s(total, last_bucket, backward_window_s), total)


FSDP_COPY_TRAFFIC = 2
"""Bytes moved per unsharded byte by an FSDP2 copy-out or copy-in: one read plus one write."""


def fsdp_comm(unit_param_bytes: list[float], group: int, link: Link, num_stages: int, num_microbatches: int,
              forward_window_s: float, backward_window_s: float, copy_bytes_per_s: float) -> DataParallelComm:
    """FSDP collectives of one stage whose units hold `unit_param_bytes` (training dtype, unsharded;
    gradients are reduced in the same dtype). Windows are one micro-batch's compute;
    `copy_bytes_per_s` is the device's achievable streaming bandwidth."""
    stage_bytes = sum(unit_param_bytes)
    if group <= 1 or stage_bytes <= 0:
        return NO_COMM
    copy_s = FSDP_COPY_TRAFFIC * stage_bytes / copy_bytes_per_s
    gathers = [all_gather_s(b, group, link) for b in unit_param_bytes]
    scatters = [reduce_scatter_s(b, group, link) for b in unit_param_bytes]
    forward = exposed_s(sum(gathers), gathers[0], forward_window_s) + copy_s
    if num_stages == 1:
        backward = exposed_s(sum(gathers) + sum(scatters), scatters[0], backward_window_s) + 2 * copy_s
        total = num_microbatches * (2 * sum(gathers) + sum(scatters))
        return DataParallelComm(forward + backward, 0.0, total)
    total = num_microbatches * sum(gathers) + sum(scatters)
    return DataParallelComm(forward, sum(scatters) + copy_s, total)
