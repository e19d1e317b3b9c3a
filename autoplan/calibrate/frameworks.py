"""Host costs of PyTorch's parallel wrappers, measured on tiny models so that only the wrapper costs.

On a GPU these hide behind kernels as long as the GPU has work queued; on a CPU every rank's one
thread pays them in full, and they dominate a small model's step:
- FSDP2 (fully_shard): per unit and micro-batch, the pre/post forward and backward hooks, the copies
  into and out of the collective buffers, and the wait for collectives started by ranks that arrive
  at different times. Measured as the extra time of fully_shard over the plain model, minus what the
  link fit already charges for the unit's three collectives (two all-gathers, one reduce-scatter).
- AdamW over DTensor parameters (FSDP2 shards, tensor-parallel weights): per tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autoplan.calibrate.measure import OPTIMIZER_TENSORS, Clock, _communication_seconds
from autoplan.cost import calibration
from autoplan.cost.pipeline import StageCost, simulate

FSDP_UNITS = 8
"""fully_shard units of the timed model: Linear(FSDP_FEATURES, FSDP_FEATURES) each."""
FSDP_FEATURES = 256
"""A unit of 257 KiB of fp32 parameters: collectives of the size a small model's layers gather."""
FEATURES = 16
BATCH = 4


def fsdp_unit_bytes() -> int:
    """Parameter bytes of one timed fully_shard unit (weight and bias, fp32)."""
    return (FSDP_FEATURES * FSDP_FEATURES + FSDP_FEATURES) * 4


def fsdp_unit_overhead_seconds(clock: Clock, mesh, collectives_s: float) -> float:
    """Extra seconds of one fully_shard unit's forward+backward (one micro-batch) over the plain unit,
    beyond `collectives_s` (what the link fits charge for its two all-gathers and one reduce-scatter of
    fsdp_unit_bytes()). Every rank of `mesh` calls this."""
    from torch.distributed.fsdp import fully_shard

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(FSDP_FEATURES, FSDP_FEATURES) for _ in range(FSDP_UNITS))).to(clock.device)

    x = torch.randn(BATCH, FSDP_FEATURES, device=clock.device)
    plain = model()
    sharded = model()
    for unit in sharded:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    def step(module: nn.Module):
        module(x).sum().backward()

    plain_s = clock.seconds(lambda: step(plain))
    sharded_s = _communication_seconds(clock, lambda: step(sharded), None, 15)
    return max(0.0, (sharded_s - plain_s) / FSDP_UNITS - collectives_s)


def optimizer_dtensor_overhead_seconds(clock: Clock, mesh) -> float:
    """Seconds torch.optim.AdamW spends per DTensor parameter sharded over `mesh` (Shard(0), a few
    elements per rank), as it updates FSDP2 shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    world = mesh.size()
    params = [nn.Parameter(distribute_tensor(torch.ones(world * 4, device=clock.device), mesh, [Shard(0)]))
              for _ in range(OPTIMIZER_TENSORS)]
    for p in params:
        p.grad = distribute_tensor(torch.ones(world * 4, device=clock.device), mesh, [Shard(0)])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
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
    Megatron MLP (fc column-parallel, GELU, proj row-parallel; autoplan.runtime.tensor_parallel, as the
    generated programs shard) forward+backward, over one rank's shard of it run on plain tensors, less
    the two all-reduces the link fits charge (`all_reduce_s` each), per counted op. Its DTensor
    dispatch (sharding propagation, redistributes, wrapping) costs far more than a replicated tiny op's.
    Every rank of `mesh` calls this."""
    from autoplan.runtime.tensor_parallel import tensor_parallel, tensor_parallel_context

    hidden = 4 * TP_FEATURES
    torch.manual_seed(0)
    sharded = tensor_parallel(_Mlp(hidden).to(clock.device), mesh, {"fc": "colwise", "proj": "rowwise"})
    local = _Mlp(hidden // mesh.size()).to(clock.device)
    x = torch.randn(TP_TOKENS, TP_FEATURES, device=clock.device, requires_grad=True)  # its gradient is all-reduced

    def step(module: nn.Module, parallel: bool) -> None:
        with tensor_parallel_context(parallel):
            module(x).sum().backward()

    plain_s = clock.seconds(lambda: step(local, False))
    parallel_s = _communication_seconds(clock, lambda: step(sharded, True), None, 15)
    return max(0.0, (parallel_s - plain_s - 2 * all_reduce_s) / TP_MLP_DTENSOR_OPS)


PIPELINE_MICROBATCHES = 8
"""Micro-batches of the timed pipeline step (GPipe over every rank, one tiny Linear stage each)."""


def pipeline_microbatch_overhead_seconds(clock: Clock, p2p_latency_s: float) -> float:
    """Host seconds torch.distributed.pipelining adds per stage and micro-batch (forward and backward
    chunk bookkeeping, batched send/recv set-up) beyond the sends the link fit charges: the overhead
    that makes the cost model's simulated GPipe schedule (cost/pipeline.py, half of it in each pass,
    one p2p latency per transfer) last as long as a measured step of tiny stages. Every rank calls this."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    stage_module = nn.Linear(FEATURES, FEATURES).to(clock.device)
    example = torch.randn(BATCH, FEATURES, device=clock.device)
    received = example.clone().requires_grad_(rank > 0)  # a later stage sends its input's gradient back
    sent = example.clone().requires_grad_(True)  # its gradient comes back from the next stage
    stage = PipelineStage(stage_module, rank, world, clock.device, input_args=(received,), output_args=(sent,))
    schedule = ScheduleGPipe(stage, n_microbatches=PIPELINE_MICROBATCHES, loss_fn=lambda out, target: out.sum())
    batch = torch.randn(BATCH * PIPELINE_MICROBATCHES, FEATURES, device=clock.device)

    def step():
        if rank == 0:
            schedule.step(batch)
        elif rank == world - 1:
            schedule.step(target=batch, losses=[])
        else:
            schedule.step()

    step_s = _communication_seconds(clock, step, None, 9)
    return overhead_matching_step(step_s, world, PIPELINE_MICROBATCHES, p2p_latency_s)


def overhead_matching_step(step_s: float, ranks: int, microbatches: int, send_s: float) -> float:
    """The per-stage, per-micro-batch host time h whose simulated GPipe step (forward h/2, backward h/2,
    `send_s` per transfer) takes `step_s`: bisection, the makespan grows with h."""
    def simulated(h: float) -> float:
        return simulate("gpipe", ranks, microbatches, [StageCost(h / 2, h / 2, send_s)] * ranks).makespan_s

    low, high = 0.0, step_s
    if simulated(low) >= step_s:
        return 0.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < step_s else (low, middle)
    return (low + high) / 2