"""Accelerators, links and clusters as plain data (no torch).

A hardware profile (profiles/*.yaml) describes one accelerator and the links between accelerators;
a Cluster adds how many there are and how they are grouped into nodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """One accelerator (or, for name "cpu", one process on this machine's CPU)."""

    name: str
    """Profile name, e.g. "h100-sxm5-80gb"."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype name ("bf16", "fp32", ...), from the datasheet."""
    memory_bytes: float
    """Device memory per accelerator, bytes."""
    memory_bandwidth_bytes_per_s: float
    """Device memory (HBM) bandwidth, bytes/s."""
    matmul_efficiency: float
    """Fraction of peak FLOP/s that large matmuls achieve (dimensionless)."""
    memory_efficiency: float
    """Fraction of peak memory bandwidth that streaming kernels achieve (dimensionless)."""
    kernel_overhead_s: float
    """Fixed cost per launched op, seconds."""
    memory_reserved_bytes: float
    """Memory not available to tensors (CUDA context, allocator fragmentation allowance), bytes."""
    source: str
    """Where the numbers come from."""


@dataclass(frozen=True)
class Link:
    """A tier of interconnect, modelled alpha-beta: time = latency + bytes * factor / bus_bandwidth."""

    name: str
    """e.g. "nvlink", "infiniband", "loopback"."""
    bus_bandwidth_bytes_per_s: float
    """Achieved collective bus bandwidth per accelerator (nccl-tests busbw), bytes/s."""
    latency_s: float
    """Per-collective (or per-message) latency, seconds."""
    source: str
    """Where the numbers come from."""


@dataclass(frozen=True)
class HardwareProfile:
    """What a profiles/*.yaml file holds."""

    gpu: Gpu
    intra_node: Link
    """Link between accelerators of one node."""
    inter_node: Link
    """Link between nodes (per accelerator)."""
    default_gpus_per_node: int
    """Accelerators per node when --gpus-per-node is not given."""


@dataclass(frozen=True)
class Cluster:
    """N accelerators of one kind, in nodes of `gpus_per_node`."""

    hardware: HardwareProfile
    num_gpus: int
    gpus_per_node: int
    memory_per_gpu_bytes: float | None = None
    """Cap on usable memory per accelerator (--memory-per-gpu); None means the device's memory."""

    @property
    def gpu(self) -> Gpu:
        return self.hardware.gpu

    @property
    def usable_memory_bytes(self) -> float:
        """Memory a plan may fill on one accelerator, bytes."""
        if self.memory_per_gpu_bytes is not None:
            return self.memory_per_gpu_bytes
        return self.gpu.memory_bytes - self.gpu.memory_reserved_bytes

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def link_for(self, group_size: int, stride: int = 1) -> Link:
        """The slowest link a group of `group_size` ranks, `stride` apart in rank order, crosses."""
        span = (group_size - 1) * stride + 1
        return self.hardware.intra_node if span <= self.gpus_per_node else self.hardware.inter_node
