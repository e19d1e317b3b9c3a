"""Accelerators, links and clusters as plain data (no torch).

A hardware profile (profiles/*.yaml) describes one accelerator and the links between accelerators;
a Cluster adds how many there are and how they are grouped into nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


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
    comm_overlap: float = 1.0
    """Share of a collective's time that can run while this device computes: 1 on GPUs (NCCL kernels run
    beside the compute stream); on a CPU, gloo's threads share the cores that compute, and
    `autoplan calibrate` measures it (time of compute and an all-reduce run together vs one after the other)."""
    concurrent_slowdown: float = 1.0
    """How much slower compute runs when every rank of a node computes at once than when one runs alone
    (>= 1): ranks on a CPU's cores share its caches and memory bandwidth; 1 on GPUs. Op times measured
    one process at a time (profile --measure) are multiplied by it."""
    optimizer_tensor_overhead_s: float = 0.0
    """Host time AdamW spends per parameter tensor beyond streaming its states, seconds: the per-tensor
    kernels of the single-tensor path (torch's default on CPU); ~0 for the foreach/fused GPU paths."""
    optimizer_dtensor_overhead_s: float = 0.0
    """The same per DTensor parameter (FSDP2 shards, tensor-parallel weights), seconds."""
    fsdp_unit_overhead_s: float = 0.0
    """Host time FSDP2 adds per unit and micro-batch beyond its collectives (hooks, buffer copies, waits
    on ranks that arrive late), seconds: measured by `autoplan calibrate` on transformer layers."""
    pipeline_microbatch_overhead_s: float = 0.0
    """Host time torch.distributed.pipelining adds per stage and micro-batch (forward and backward chunk
    bookkeeping, send/recv set-up) beyond the compute and the sends, seconds."""
    pipeline_compute_slowdown: float = 0.0
    """How much slower a stage's compute runs inside torch.distributed.pipelining than alone, as a
    fraction (0.2: 20% slower): on a CPU the transfers' threads compete with the stage's ops for cores.
    With pipeline_microbatch_overhead_s it is fitted by `autoplan calibrate` so the simulated GPipe
    steps of one-transformer-layer stages at two micro-batch sizes last as measured: on 2 CPU ranks the
    extra time per stage and micro-batch grew with the stage's compute (0.9 ms beside 4.4 ms, 6.9 ms
    beside 31 ms), and five calibrations fitted 0.04-0.19 with a constant of 0.6-2.0 ms. ~0 on GPUs,
    whose kernels do not share cores with the host."""
    ddp_tensor_overhead_s: float = 0.0
    """Time DistributedDataParallel adds to a step per parameter tensor beyond its gradient all-reduce
    (autograd hooks, bucketing, and on a CPU the all-reduce's contention with the backward it runs
    beside), seconds: measured on transformer layers under DDP."""
    dtensor_op_overhead_s: float = 0.0
    """Extra host time of one op on DTensors over the same op on plain tensors (sharding propagation,
    redistribution, wrapping), seconds: paid by the ops of tensor-parallel regions (cost/compute.py counts
    them); measured on a tensor-parallel MLP."""


@dataclass(frozen=True)
class AlphaBeta:
    """One collective's alpha-beta parameters on a link."""

    latency_s: float
    bus_bandwidth_bytes_per_s: float


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
    collectives: dict[str, AlphaBeta] = field(default_factory=dict)
    """Per-operation fits ("all_reduce", "all_gather", "reduce_scatter", "p2p") where they were measured
    (autoplan calibrate): gloo, say, runs each with a different algorithm; others use the link's own."""

    def alpha_beta(self, op: str) -> AlphaBeta:
        """Latency and bus bandwidth of `op` on this link."""
        return self.collectives.get(op) or AlphaBeta(self.latency_s, self.bus_bandwidth_bytes_per_s)

    def with_bus_bandwidth(self, bus_bandwidth_bytes_per_s: float) -> "Link":
        """This link with its bandwidth (and every per-operation bandwidth) scaled to the given one."""
        ratio = bus_bandwidth_bytes_per_s / self.bus_bandwidth_bytes_per_s
        scaled = {op: AlphaBeta(ab.latency_s, ab.bus_bandwidth_bytes_per_s * ratio) for op, ab in self.collectives.items()}
        return replace(self, bus_bandwidth_bytes_per_s=bus_bandwidth_bytes_per_s, collectives=scaled)


@dataclass(frozen=True)
class Host:
    """The CPU side of a node: what CPU offload (FSDP2's CPUOffloadPolicy) keeps the model states in, moves
    them over and steps the optimizer on."""

    memory_bytes: float
    """Host memory (DRAM) per node, bytes."""
    memory_bandwidth_bytes_per_s: float
    """Host memory bandwidth per node, all sockets, bytes/s (what the CPU optimizer step streams through)."""
    memory_efficiency: float
    """Fraction of it that the CPU AdamW step sustains (dimensionless)."""
    link_bandwidth_bytes_per_s: float
    """Achieved host-to-device copy bandwidth per accelerator, each direction, pinned memory, bytes/s (PCIe,
    or NVLink-C2C on Grace Hopper); 0 when the device is the host (no offload possible)."""
    source: str
    """Where the numbers come from."""


DEFAULT_HOST = Host(memory_bytes=1024 * 2.0**30, memory_bandwidth_bytes_per_s=200e9, memory_efficiency=0.6,
                    link_bandwidth_bytes_per_s=25e9,
                    source="default for a profile without a host section: a PCIe Gen4 x16 server (32 GB/s per "
                           "direction, ~25 achieved), 1 TiB of 8-channel DDR4-3200 (205 GB/s per socket)")
"""What a hardware profile without a `host:` section gets (profiles/*.yaml give their node's own)."""


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
    host: Host = DEFAULT_HOST
    """The node's CPU side (memory, its bandwidth, the host-device link)."""


@dataclass(frozen=True)
class Cluster:
    """N accelerators of one kind, in nodes of `gpus_per_node`."""

    hardware: HardwareProfile
    num_gpus: int
    gpus_per_node: int
    memory_per_gpu_bytes: float | None = None
    """Cap on usable memory per accelerator (--memory-per-gpu); None means the device's memory."""
    host_memory_per_node_bytes: float | None = None
    """Host memory per node (--host-memory-per-node); None means the profile's Host.memory_bytes."""

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
    def host_memory_bytes(self) -> float:
        """Host memory a plan may fill on one node (CPU offload), bytes."""
        if self.host_memory_per_node_bytes is not None:
            return self.host_memory_per_node_bytes
        return self.hardware.host.memory_bytes

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def link_for(self, group_size: int, stride: int = 1) -> Link:
        """The slowest link a group of `group_size` ranks, `stride` apart in rank order, crosses."""
        span = (group_size - 1) * stride + 1
        return self.hardware.intra_node if span <= self.gpus_per_node else self.hardware.inter_node
