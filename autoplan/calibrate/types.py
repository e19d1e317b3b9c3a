"""What one calibration run measured, as plain data (no torch): the worker fills it, the writer turns
it into a hardware profile, the YAML keeps it under `measurements:`."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUNDS = 3
"""Times each probe of a calibration's framework phase runs, in turns (every probe once, then again);
the median is kept. One run of each on 2 CPU ranks ranged over 2x between runs a minute apart (FSDP2
unit 4.9-9.7 ms, DTensor op 0.27-0.82 ms): the VM's slow spells last seconds."""


@dataclass(frozen=True)
class TierTimes:
    """Median times of the operations on one link tier (intra- or inter-node)."""

    group_size: int
    """Ranks in each collective's group (2 for p2p)."""
    seconds: dict[str, dict[int, float]]
    """op name (all_reduce, all_gather, reduce_scatter, p2p) -> message bytes -> seconds (median over
    repeats of the slowest rank). Message bytes are the full (unsharded) tensor for the collectives and
    the bytes sent for p2p, as in autoplan/cost/comm.py."""
    copied_from: str = ""
    """Non-empty when this tier was not measured but copied (e.g. "intra_node" on a single node)."""


@dataclass(frozen=True)
class Measurements:
    """Everything one `autoplan calibrate` run measured. Per-rank numbers are the median over ranks of each
    rank's median over repeats."""

    date: str
    """ISO 8601 time of the run (UTC)."""
    torch_version: str
    device: str
    """"cpu" or "cuda"."""
    device_name: str
    """Processor or GPU model, as torch/platform report it."""
    backend: str
    """"gloo" or "nccl"."""
    world_size: int
    ranks_per_node: int
    """LOCAL_WORLD_SIZE: ranks on each node."""
    threads_per_rank: int
    """Intra-op threads of each rank (1 on CPU: one rank = one process on one core)."""
    matmul_flops_per_s: dict[str, dict[int, float]]
    """dtype -> n (square n x n @ n x n matmul) -> achieved FLOP/s (2 n^3 per matmul)."""
    copy_bytes_per_s: dict[int, float]
    """Tensor bytes copied (src -> dst) -> achieved bytes moved per second (read + write = 2x bytes)."""
    kernel_overhead_s: float
    """Time of one tiny op (1-element add), seconds: dispatch and launch cost."""
    tiers: dict[str, TierTimes]
    """"intra_node" and "inter_node" -> link times; empty when the run had one rank (`links_not_measured`)."""
    resident_bytes: float
    """Memory a rank holds before any tensor: RSS on CPU; CUDA context and library workspaces on GPU."""
    device_memory_bytes: float | None = None
    """Total device memory (CUDA), None on CPU."""
    peak_allocated_bytes: float | None = None
    """torch.cuda.max_memory_allocated() over the run (CUDA), None on CPU."""
    devices_per_node: int | None = None
    """GPUs on this node (CUDA), None on CPU."""
    comm_overlap: float | None = None
    """Share of an all-reduce hidden behind matmuls running at the same time (None: not measured)."""
    concurrent_slowdown: float | None = None
    """Step time of a transformer layer with every rank running it over rank 0 alone (None: not measured)."""
    ddp_tensor_overhead_s: float | None = None
    """DDP's extra step time per parameter tensor beyond its modeled all-reduce (None: not measured)."""
    fsdp_unit_overhead_s: float | None = None
    """Extra seconds of a fully_shard unit's forward+backward beyond its collectives' latency (None: not measured)."""
    pipeline_microbatch_overhead_s: float | None = None
    """Host seconds pipelining adds per stage and micro-batch beyond its sends (None: not measured)."""
    pipeline_compute_slowdown: float | None = None
    """Fraction by which a stage's compute runs slower inside pipelining than alone (None: not measured)."""
    optimizer_dtensor_overhead_s: float | None = None
    """AdamW step time per DTensor parameter shard, seconds (None: not measured)."""
    dtensor_op_overhead_s: float | None = None
    """Host time per DTensor op of a tensor-parallel MLP over its plain local shard, beyond its modeled
    all-reduces, seconds (None: not measured)."""
    optimizer_tensor_overhead_s: float | None = None
    """AdamW step time per one-element parameter tensor, seconds (None: not measured)."""
    links_not_measured: str = ""
    """Why no link was measured (a run on one rank), "" when they were: the profile keeps its base's links."""
    extra: dict[str, float] = field(default_factory=dict)
    """Other numbers worth keeping (e.g. per-rank spread), written as they are."""


@dataclass(frozen=True)
class RunSizes:
    """What one device kind is timed at. Sizes are chosen to keep a CPU run of 2 ranks under ~30 s."""

    matmul_dtypes: tuple[str, ...]
    """dtype names timed (profile keys: "fp32", "bf16", "fp16", "tf32" = fp32 inputs on TF32 tensor cores)."""
    primary_dtype: str
    """The dtype whose efficiency the profile carries: the planner's default training dtype."""
    matmul_sizes: tuple[int, ...]
    """n of the square matmuls timed."""
    typical_sizes: tuple[int, ...]
    """Matmul sizes typical of what gets planned on this device: matmul_efficiency is measured at these."""
    copy_bytes: tuple[int, ...]
    """Sizes of the copies timed; the largest is well beyond the last-level cache."""
    message_bytes: tuple[int, ...]
    """Message sizes of the collectives and sends timed."""
    repeats: int
    """Timed repeats per collective and size (the median is kept), after one warm-up call."""
    overlap_message_bytes: int = 8 * 2**20
    """All-reduce size of the compute/communication overlap measurement."""
    overlap_matmul_n: int = 256
    """n of the square matmuls run beside it."""


KIB, MIB = 2**10, 2**20

SIZES = {
    # one rank = one process on one core (torch.set_num_threads(1)); L3 caches are tens of MiB
    "cpu": RunSizes(matmul_dtypes=("fp32", "bf16"), primary_dtype="fp32", matmul_sizes=(128, 256, 512, 1024),
                    typical_sizes=(256, 512), copy_bytes=(1 * MIB, 4 * MIB, 16 * MIB, 128 * MIB),
                    message_bytes=tuple(4 * KIB * 4**i for i in range(7)), repeats=15),
    # GPU GEMMs reach their plateau near n = 4096-8192; NCCL busbw saturates near 256 MiB messages
    "cuda": RunSizes(matmul_dtypes=("bf16", "fp16", "tf32", "fp32"), primary_dtype="bf16",
                     matmul_sizes=(1024, 2048, 4096, 8192), typical_sizes=(2048, 4096),
                     copy_bytes=(16 * MIB, 256 * MIB, 1024 * MIB),
                     message_bytes=tuple(4 * KIB * 4**i for i in range(9)), repeats=20,
                     overlap_message_bytes=256 * MIB, overlap_matmul_n=4096),
}
"""Run sizes per device ("cpu", "cuda")."""
