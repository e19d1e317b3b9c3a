"""Time and activation memory of every unit for one micro-batch, model FLOPs and the optimizer step.

Per op (cost/units.py), at micro-batch size b, tensor-parallel degree t (split ops only) and the
training dtype (bytes scaled by its element size over the capture's):

    forward  = max(F / (peak x eff_kind), bytes / (HBM x memory_efficiency)) + launches x overhead
    backward = max(F_bwd / (peak x eff_kind), 2 x bytes / (HBM x memory_efficiency)) + launches x overhead

roofline on the cluster's accelerator, eff_kind = Gpu.matmul_efficiency for weight matmuls and
calibration.ATTENTION_EFFICIENCY for attention; memory-bound ops cost their bytes. Views cost nothing.
When the profile was measured on this machine and the plan is for it (device "cpu"), measured times
are used instead: a fixed launch part plus a part proportional to the batch, the split ops' share
divided by t.

Tensor-parallel collectives per unit: an all-reduce of each rowwise Linear's output (and of a
vocabulary-parallel embedding's output) in forward, of each colwise Linear's input gradient in
backward, and an all-gather of a vocabulary-parallel head's logits in forward (alpha-beta, cost/comm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from autoplan.cost import calibration, comm
from autoplan.cost.dtypes import activation_scale, peak_flops
from autoplan.cost.units import MODES, SPLIT_ROLES, ChainCosts, OpCost, UnitCosts, saved_by_mode
from autoplan.hardware.types import Gpu, Link
from autoplan.solve.layers import LayerChain

ADAMW_BYTES_PER_PARAM = 28
"""Memory traffic of one AdamW step per parameter (torch.optim.AdamW, foreach): fp32 reads
weight, grad, exp_avg, exp_avg_sq (16 B) and writes weight, exp_avg, exp_avg_sq (12 B); bf16 mixed
reads master, bf16 grad, exp_avg, exp_avg_sq (14 B) and writes master, moments, bf16 copy (14 B)."""


@dataclass(frozen=True)
class UnitTable:
    """Costs of every unit for one micro-batch at one (tensor-parallel degree, micro-batch size)."""

    forward_s: tuple[float, ...]
    """Forward compute, seconds."""
    backward_s: tuple[float, ...]
    tp_forward_s: tuple[float, ...]
    """Tensor-parallel collectives of the forward (exposed), seconds."""
    tp_backward_s: tuple[float, ...]
    cheap_forward_s: tuple[float, ...]
    """Forward of the memory-bound ops: what selective recompute repeats, seconds."""
    activation_bytes: dict[str, tuple[float, ...]]
    """Recompute mode -> bytes each unit keeps for backward per micro-batch (training dtype)."""
    working_bytes: tuple[float, ...]
    """Transient bytes while the unit runs its backward (its full activations, and the loss's logits
    copies on the output unit)."""

    def time_s(self, mode: str) -> tuple[float, ...]:
        """Forward + backward (+ recompute) + tensor-parallel collectives of each unit, seconds."""
        return self._times[mode]

    @cached_property
    def _times(self) -> dict[str, tuple[float, ...]]:
        return {m: tuple(self._unit_time(u, m) for u in range(len(self.forward_s))) for m in MODES}

    @cached_property
    def total_s(self) -> dict[str, float]:
        """Sum over units of time_s(mode)."""
        return {m: sum(t) for m, t in self._times.items()}

    def _unit_time(self, u: int, mode: str) -> float:
        base = self.forward_s[u] + self.backward_s[u] + self.tp_forward_s[u] + self.tp_backward_s[u]
        if mode == "selective":
            return base + self.cheap_forward_s[u]
        if mode == "full":
            return base + self.forward_s[u] + self.tp_forward_s[u]
        return base


def unit_table(costs: ChainCosts, gpu: Gpu, capture_dtype: str, train_dtype: str, tp: int, microbatch: int,
               tp_link: Link, use_measured: bool) -> UnitTable:
    """Per-unit costs; identical units (ChainCosts.signature) are computed once."""
    scale = activation_scale(capture_dtype, train_dtype)
    done: dict[int, tuple] = {}
    rows = []
    for u, unit in enumerate(costs.units):
        key = costs.signature[u]
        if key not in done:
            done[key] = _unit_row(unit, gpu, train_dtype, scale, tp, microbatch, tp_link, use_measured)
        rows.append(done[key])
    columns = list(zip(*rows))
    activations = {m: tuple(r[5][m] for r in rows) for m in MODES}
    return UnitTable(*(tuple(c) for c in columns[:5]), activations, tuple(columns[6]))


def _unit_row(unit: UnitCosts, gpu: Gpu, dtype: str, scale: float, tp: int, b: int, link: Link, measured: bool):
    fwd = bwd = cheap = tp_fwd = tp_bwd = 0.0
    for op in unit.ops:
        f, g = (_measured(op, gpu, tp, b) if measured and op.measured else _roofline(op, gpu, dtype, scale, tp, b))
        fwd, bwd = fwd + f, bwd + g
        if op.kind == "memory":
            cheap += f
        tp_fwd += _tp_forward(op, tp, b * scale, link)
        tp_bwd += _tp_backward(op, tp, b * scale, link)
    saved = saved_by_mode(unit, tp, scale)
    activations = {m: saved[m] * b for m in MODES}
    working = saved["none"] * b + calibration.LOSS_BUFFER_FACTOR * unit.output_buffer_bytes * b * scale
    return fwd, bwd, tp_fwd, tp_bwd, cheap, activations, working


def _efficiency(op: OpCost, gpu: Gpu) -> float:
    return calibration.ATTENTION_EFFICIENCY if op.kind == "attention" else gpu.matmul_efficiency


def _roofline(op: OpCost, gpu: Gpu, dtype: str, scale: float, tp: int, b: int) -> tuple[float, float]:
    if op.kind == "view":
        return 0.0, 0.0
    split = tp if op.tp_role in SPLIT_ROLES else 1
    flops_per_s = peak_flops(gpu, dtype) * _efficiency(op, gpu)
    bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    traffic = (op.activation_bytes * b + op.parameter_bytes) * scale / split
    forward = max(op.flops_fwd * b / split / flops_per_s, traffic / bytes_per_s) + gpu.kernel_overhead_s
    if not op.has_backward:
        return forward, 0.0
    kernels = calibration.GEMM_BACKWARD_KERNELS if op.kind == "gemm" else 1
    backward = max(op.flops_bwd * b / split / flops_per_s,
                   calibration.BACKWARD_TRAFFIC_FACTOR * traffic / bytes_per_s) + kernels * gpu.kernel_overhead_s
    return forward, backward


def _measured(op: OpCost, gpu: Gpu, tp: int, b: int) -> tuple[float, float]:
    """A launch part that does not shrink with the batch, the rest proportional to it."""
    split = tp if op.tp_role in SPLIT_ROLES else 1
    backward_kernels = calibration.GEMM_BACKWARD_KERNELS if op.kind == "gemm" else 1
    out = []
    for measured, kernels in ((op.time_fwd_s, 1), (op.time_bwd_s, backward_kernels)):
        fixed = min(measured, kernels * gpu.kernel_overhead_s)
        out.append(fixed + (measured - fixed) * b / op.profile_batch / split if measured > 0.0 else 0.0)
    return out[0], out[1]


def _tp_forward(op: OpCost, tp: int, per_mb: float, link: Link) -> float:
    if tp == 1:
        return 0.0
    if op.tp_role in ("rowwise", "embedding"):
        return comm.all_reduce_s(op.output_bytes * per_mb, tp, link)
    if op.tp_role == "head":
        return comm.all_gather_s(op.output_bytes * per_mb, tp, link)
    return 0.0


def _tp_backward(op: OpCost, tp: int, per_mb: float, link: Link) -> float:
    if tp == 1 or op.tp_role not in ("colwise", "head"):
        return 0.0
    return comm.all_reduce_s(op.input_activation_bytes * per_mb, tp, link)


def optimizer_step_time(parameters_on_rank: float, gpu: Gpu) -> float:
    """AdamW over the parameters a rank updates: memory-bound streaming of its states."""
    return parameters_on_rank * ADAMW_BYTES_PER_PARAM / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


def model_flops_per_step(chain: LayerChain, global_batch_size: int) -> float:
    """Forward + backward FLOPs of one optimizer step, without recomputation."""
    return chain.flops_per_sample * global_batch_size


def mfu(model_flops: float, step_time_s: float, num_gpus: int, gpu: Gpu, train_dtype: str) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the cluster's peak in the training dtype."""
    return model_flops / (step_time_s * num_gpus * peak_flops(gpu, train_dtype))
