"""Host costs of PyTorch's parallel wrappers, measured where they would be paid.

On a GPU these hide behind kernels as long as the GPU has work queued; on a CPU every rank's one
thread pays them in full, and they dominate a small model's step. Each is the extra time of the
wrapped model over the plain one, less what the link fits already charge for its collectives, on a
model with real compute where the collectives compete with it as in training (on tiny models the
same wrappers measured half as costly on this project's 2-core VM):
- FSDP2 (fully_shard): per unit and micro-batch, the pre/post forward and backward hooks, the copies
  into and out of the collective buffers, and the wait for collectives started by ranks that arrive
  at different times; transformer layers with attention, Linears and norms as units.
- DDP: per parameter tensor (hooks, bucketing, the all-reduce beside the backward).
- Tensor parallelism: per DTensor op of a Megatron MLP.
- Pipelining: per stage and micro-batch, a constant plus a share of the stage's compute, fitted with
  the cost model's schedule simulation at two stage sizes.
- AdamW over DTensor parameters (FSDP2 shards, tensor-parallel weights): per tensor.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.calibrate.measure import OPTIMIZER_TENSORS, Clock, transformer_layers
from autoplan.calibrate.types import ROUNDS
from autoplan.cost import calibration
from autoplan.cost.pipeline import StageCost, simulate
from autoplan.runtime.components.optimizer import adamw

LAYERS = 2
"""Transformer layers (width 128, 4 heads, MLP 512) under the timed DDP and fully_shard: a small model's
compute, so the wrappers' collectives and hooks compete with a real backward as in training."""
LAYER_INPUT = (8, 64, 128)
"""Batch, sequence and width of their input."""
FSDP_UNIT_NAMES = ("self_attn", "linear1", "linear2", "norm1", "norm2")
"""Submodules of each timed transformer layer that fully_shard makes a unit (attention, the two MLP
Linears, the two norms: the mix of a transformer's units)."""


def in_rounds(probes: dict[str, Callable[[], Any]], rounds: int = ROUNDS) -> dict[str, Any]:
    """Each probe's median over `rounds` runs (of each number, for a probe returning a tuple), the probes
    taking turns. Every rank calls this with the same probes in the same order (they communicate)."""
    found: dict[str, list] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            found[name].append(probe())
    return {name: tuple(map(statistics.median, zip(*values))) if isinstance(values[0], tuple)
            else statistics.median(values) for name, values in found.items()}


def ddp_gradient_bytes() -> int:
    """Bytes of the timed layers' gradients (fp32), which DDP all-reduces."""
    return sum(p.numel() for p in transformer_layers(torch.device("cpu"), LAYERS).parameters()) * 4


WRAPPED_PAIRS = 15
"""(plain, wrapped) steps timed back to back; the median of their differences is kept. Two medians
timed a second apart differ by the machine's drift: on 2 CPU ranks DDP's extra time per parameter
tensor came out anywhere in 0-490 us that way."""


def _paired_times(clock: Clock, first: Callable[[], object], second: Callable[[], object],
                  pairs: int) -> list[tuple[float, float]]:
    """(first, second) seconds of `pairs` back-to-back runs of both callables, each run started on every
    rank together after a barrier and timed as its slowest rank's (what a step waits for), after one
    warm-up run of each (connection set-up, buffers). Every rank calls this."""
    first()
    second()
    samples = []
    for _ in range(pairs):
        for fn in (first, second):
            dist.barrier()
            clock.sync()
            samples.append(clock.once(fn))
    times = clock.numbers(samples).view(pairs, 2)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return [(a, b) for a, b in times.tolist()]


def _median_extra_seconds(clock: Clock, plain: Callable[[], object], wrapped: Callable[[], object]) -> float:
    """Median over WRAPPED_PAIRS back-to-back (plain, wrapped) runs of the wrapped run's extra seconds."""
    return statistics.median(b - a for a, b in _paired_times(clock, plain, wrapped, WRAPPED_PAIRS))


def _wrapped_extra_seconds(clock: Clock, wrapped: nn.Module) -> float:
    """Forward+backward seconds of `wrapped` (transformer_layers under DDP or fully_shard) over the plain
    layers, both run by every rank at once, paired (_median_extra_seconds)."""
    plain = transformer_layers(clock.device, LAYERS)
    x = torch.randn(*LAYER_INPUT, device=clock.device)

    def step(module: nn.Module):
        def run() -> None:
            module.zero_grad(set_to_none=True)
            module(x).sum().backward()
        return run

    return _median_extra_seconds(clock, step(plain), step(wrapped))


def fsdp_unit_overhead_seconds(clock: Clock, mesh, collectives_s: Callable[[int], float]) -> float:
    """Extra seconds of one fully_shard unit's forward+backward (one micro-batch) over the plain unit,
    beyond what the link fits charge for its two all-gathers and one reduce-scatter
    (`collectives_s(unit parameter bytes)`): transformer_layers with each of their FSDP_UNIT_NAMES a
    unit, per unit. Every rank of `mesh` calls this."""
    from torch.distributed.fsdp import fully_shard

    sharded = transformer_layers(clock.device, LAYERS)
    units = [getattr(layer, name) for layer in sharded for name in FSDP_UNIT_NAMES]
    unit_bytes = [sum(p.numel() for p in unit.parameters()) * 4 for unit in units]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    charged = sum(collectives_s(b) for b in unit_bytes)
    return max(0.0, (_wrapped_extra_seconds(clock, sharded) - charged) / len(units))


def ddp_tensor_overhead_seconds(clock: Clock, all_reduce_s: float) -> float:
    """Seconds DistributedDataParallel adds to a step per parameter tensor beyond the all-reduce of its
    gradients as the link fit charges it (`all_reduce_s`): transformer_layers under DDP, per parameter
    tensor. What it counts: autograd hooks and bucketing, and on a CPU the all-reduce threads competing
    with the backward's. Every rank calls this."""
    from torch.nn.parallel import DistributedDataParallel

    replicated = DistributedDataParallel(transformer_layers(clock.device, LAYERS), gradient_as_bucket_view=True,
                                         device_ids=[clock.device.index] if clock.device.type == "cuda" else None)
    tensors = sum(1 for _ in replicated.parameters())
    return max(0.0, (_wrapped_extra_seconds(clock, replicated) - all_reduce_s) / tensors)


def optimizer_dtensor_overhead_seconds(clock: Clock, mesh) -> float:
    """Seconds torch.optim.AdamW (runtime.adamw, fused, as train.py runs it) spends per DTensor parameter
    sharded over `mesh` (Shard(0), a few elements per rank), as it updates FSDP2 shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = mesh.size()
    params = [nn.Parameter(distribute_tensor(torch.ones(world * 4, device=clock.device), mesh, [Shard(0)]))
              for _ in range(OPTIMIZER_TENSORS)]
    for p in params:
        p.grad = distribute_tensor(torch.ones(world * 4, device=clock.device), mesh, [Shard(0)])
    optimizer = adamw(params, lr=1e-3)
    dist.barrier()
    return clock.seconds(optimizer.step) / OPTIMIZER_TENSORS


TP_FEATURES = 128
"""Model width of the timed tensor-parallel MLP (hidden 4x)."""
TP_TOKENS = 1024
"""Rows of its input (batch x sequence). Part of DTensor's extra time grows with the activations
(on 2 CPU ranks: ~320 us per op at 64 x 64, ~500 us at 1024 x 128), so the MLP is the size of a
small model's layer rather than a tiny one."""
TP_MLP_DTENSOR_OPS = 2 * (calibration.TP_DTENSOR_FORWARD_OPS + calibration.TP_DTENSOR_BACKWARD_OPS) + 2
"""DTensor ops the cost model counts for that MLP (cost/compute.py): two sharded Linears, and the GELU
between them in forward and backward."""


def tp_mlp_all_reduce_bytes() -> int:
    """Bytes of each of the timed MLP's two all-reduces (its output in forward, its input's gradient in
    backward): TP_TOKENS x TP_FEATURES fp32."""
    return TP_TOKENS * TP_FEATURES * 4


class _Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(TP_FEATURES, hidden)
        self.proj = nn.Linear(hidden, TP_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


def tensor_parallel_op_overhead_seconds(clock: Clock, mesh, all_reduce_s: float) -> float:
    """Host seconds per DTensor op of a tensor-parallel region, as the cost model counts the ops: a
    Megatron MLP (fc column-parallel, GELU, proj row-parallel; autoplan.runtime.distributed.tensor_parallel, as the
    generated programs shard) forward+backward, over one rank's shard of it run on plain tensors, less
    the two all-reduces the link fits charge (`all_reduce_s` each), per counted op. Its DTensor
    dispatch (sharding propagation, redistributes, wrapping) costs far more than a replicated tiny op's.
    Every rank of `mesh` calls this."""
    from autoplan.runtime.distributed.tensor_parallel import tensor_parallel, tensor_parallel_context

    hidden = 4 * TP_FEATURES
    torch.manual_seed(0)
    sharded = tensor_parallel(_Mlp(hidden).to(clock.device), mesh, {"fc": "colwise", "proj": "rowwise"})
    local = _Mlp(hidden // mesh.size()).to(clock.device)
    x = torch.randn(TP_TOKENS, TP_FEATURES, device=clock.device, requires_grad=True)  # its gradient is all-reduced

    def step(module: nn.Module, parallel: bool):
        def run() -> None:
            with tensor_parallel_context(parallel):
                module(x).sum().backward()
        return run

    extra_s = _median_extra_seconds(clock, step(local, False), step(sharded, True))
    return max(0.0, (extra_s - 2 * all_reduce_s) / TP_MLP_DTENSOR_OPS)


PIPELINE_MICROBATCHES = 8
"""Micro-batches of the timed pipeline step (GPipe over every rank, one transformer layer per stage)."""
PIPELINE_MICROBATCH_SIZES = ((2, 64, 128), (16, 64, 128))
"""Batch, sequence and width of one micro-batch, at the two sizes the pipelining overhead is fitted at:
on 2 CPU ranks the extra time per stage and micro-batch grew with the stage's compute (2 ms beside 5 ms
of compute, 5-7 ms beside 22-31 ms), so a constant fitted at one size under-priced bigger stages."""
PIPELINE_PAIRS = 7
"""(stage alone, pipelined) steps timed back to back; the overhead is fitted per pair and the median
kept. One fit from a pipelined median and a stage timed seconds apart gave 1.2-4.0 ms per stage and
micro-batch over four calibrations on 2 CPU ranks."""


def pipelined_stage_seconds(clock: Clock, p2p_latency_s: float, shape: tuple[int, int, int]) -> tuple[float, float]:
    """(compute, extra) seconds per stage and micro-batch of a GPipe step over every rank, one
    transformer layer per stage, micro-batches of `shape`: compute is the slowest stage's forward+backward
    alone, extra the host time h that makes the cost model's simulated GPipe schedule (cost/pipeline.py:
    the stage's own forward and backward plus h/2 in each pass, one p2p latency per transfer) last as
    long as the measured step. Each pair times every rank's stage alone over all micro-batches (no
    transfers), then the pipelined step; medians over PIPELINE_PAIRS pairs. Every rank calls this."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    stage_module = transformer_layers(clock.device)
    example = torch.randn(*shape, device=clock.device)
    # the forward's share of a forward+backward, to split each pair's measured stage time
    forward_share = clock.seconds(lambda: stage_module(example)) / clock.seconds(
        lambda: stage_module(example).sum().backward())
    received = example.clone().requires_grad_(rank > 0)  # a later stage sends its input's gradient back
    sent = example.clone().requires_grad_(True)  # its gradient comes back from the next stage
    stage = PipelineStage(stage_module, rank, world, clock.device, input_args=(received,), output_args=(sent,))
    schedule = ScheduleGPipe(stage, n_microbatches=PIPELINE_MICROBATCHES, loss_fn=lambda out, target: out.sum())
    batch = torch.randn(shape[0] * PIPELINE_MICROBATCHES, *shape[1:], device=clock.device)

    def alone():
        stage_module.zero_grad(set_to_none=True)
        for _ in range(PIPELINE_MICROBATCHES):
            stage_module(example).sum().backward()

    def pipelined():
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=batch, losses=[])
        else:
            schedule.step()

    computes, fits = [], []
    for alone_s, step_s in _paired_times(clock, alone, pipelined, PIPELINE_PAIRS):
        per_microbatch = alone_s / PIPELINE_MICROBATCHES
        computes.append(per_microbatch)
        fits.append(overhead_matching_step(step_s, world, PIPELINE_MICROBATCHES, p2p_latency_s,
                                           forward_share * per_microbatch, (1 - forward_share) * per_microbatch))
    return statistics.median(computes), statistics.median(fits)


def pipeline_overheads(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(constant seconds, slowdown fraction) of the line extra = constant + slowdown x compute through
    the (compute, extra) of pipelined_stage_seconds at two micro-batch sizes, both kept >= 0."""
    (c1, h1), (c2, h2) = sorted((small, large))
    slowdown = max(0.0, (h2 - h1) / (c2 - c1)) if c2 > c1 else 0.0
    constant = max(0.0, h1 - slowdown * c1)
    if constant == 0.0 and c1 + c2 > 0:  # the line crosses below 0: through the origin, least squares
        slowdown = max(0.0, (c1 * h1 + c2 * h2) / (c1 * c1 + c2 * c2))
    return constant, slowdown


def overhead_matching_step(step_s: float, ranks: int, microbatches: int, send_s: float,
                           forward_s: float = 0.0, backward_s: float = 0.0) -> float:
    """The per-stage, per-micro-batch host time h whose simulated GPipe step (stages of `forward_s` +
    h/2 and `backward_s` + h/2, `send_s` per transfer) takes `step_s`: bisection, the makespan grows
    with h."""
    def simulated(h: float) -> float:
        stage = StageCost(forward_s + h / 2, backward_s + h / 2, send_s)
        return simulate("gpipe", ranks, microbatches, [stage] * ranks).makespan_s

    low, high = 0.0, step_s
    if simulated(low) >= step_s:
        return 0.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < step_s else (low, middle)
    return (low + high) / 2
