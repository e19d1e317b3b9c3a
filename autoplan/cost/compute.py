"""Compute time of each unit for one micro-batch, model FLOPs and the optimizer step.

A unit's profiled time at the profile's batch B splits into a fixed part (kernel launches, which
do not shrink with the batch) and a part proportional to the batch:

    fixed      = min(time, ops x kernels per op x Gpu.kernel_overhead_s)
    time(mbs)  = fixed + (time - fixed) x mbs / B

When the profile is a roofline for a named accelerator (device != "cpu") and training uses a
different dtype than the capture, the proportional part is split into a compute-bound share
(the unit's FLOPs at the capture dtype's achievable peak) scaled by the peak ratio, and the rest
(memory-bound) scaled by the ratio of element sizes. CPU timings are measured and used as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.dtypes import bytes_per_element, canonical, peak_flops
from autoplan.hardware.types import Gpu
from autoplan.solve.layers import LayerChain, Unit

KERNELS_PER_OP = {"fwd": 1, "bwd": 2}
"""Kernels launched per op: one forward; backward computes input and weight gradients (two)."""

ADAMW_BYTES_PER_PARAM = 28
"""Memory traffic of one AdamW step per parameter (torch.optim.AdamW, foreach): fp32 reads
weight, grad, exp_avg, exp_avg_sq (16 B) and writes weight, exp_avg, exp_avg_sq (12 B); bf16 mixed
reads master, bf16 grad, exp_avg, exp_avg_sq (14 B) and writes master, moments, bf16 copy (14 B)."""


@dataclass(frozen=True)
class UnitTimes:
    """Per-unit times of one micro-batch, seconds."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]

    @property
    def total(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.fwd, self.bwd))


def unit_times(chain: LayerChain, gpu: Gpu, train_dtype: str, microbatch_size: int) -> UnitTimes:
    """Forward and backward time of every unit at `microbatch_size` samples in `train_dtype`."""
    fwd = tuple(_scaled(chain, u, gpu, train_dtype, microbatch_size, "fwd") for u in chain.units)
    bwd = tuple(_scaled(chain, u, gpu, train_dtype, microbatch_size, "bwd") for u in chain.units)
    return UnitTimes(fwd, bwd)


def _scaled(chain: LayerChain, unit: Unit, gpu: Gpu, train_dtype: str, mbs: int, phase: str) -> float:
    batch = chain.profile_batch_size
    per_sample_time = unit.time_fwd_s if phase == "fwd" else unit.time_bwd_s
    flops = (unit.flops_fwd if phase == "fwd" else unit.flops_bwd) * batch
    time = per_sample_time * batch
    if time <= 0.0 and flops > 0.0:
        time = _roofline(unit, gpu, chain.capture_dtype, phase, batch)
    fixed = min(time, unit.op_count * KERNELS_PER_OP[phase] * gpu.kernel_overhead_s)
    proportional = time - fixed
    capture, train = canonical(chain.capture_dtype), canonical(train_dtype)
    if chain.device != "cpu" and capture != train and proportional > 0.0:
        capture_peak = peak_flops(gpu, capture) * gpu.matmul_efficiency
        compute_bound = min(proportional, flops / capture_peak)
        memory_bound = proportional - compute_bound
        proportional = (compute_bound * capture_peak / (peak_flops(gpu, train) * gpu.matmul_efficiency)
                        + memory_bound * bytes_per_element(train) / bytes_per_element(capture))
    return fixed + proportional * mbs / batch


def _roofline(unit: Unit, gpu: Gpu, capture_dtype: str, phase: str, batch: int) -> float:
    """Fallback when a profile carries no times: max(compute, memory) of the unit as a whole
    (backward moves about twice the forward's bytes: gradients of inputs and weights)."""
    flops = (unit.flops_fwd if phase == "fwd" else unit.flops_bwd) * batch
    traffic = unit.memory_traffic_bytes * batch * KERNELS_PER_OP[phase]
    compute_s = flops / (peak_flops(gpu, capture_dtype) * gpu.matmul_efficiency)
    memory_s = traffic / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    return max(compute_s, memory_s) + unit.op_count * KERNELS_PER_OP[phase] * gpu.kernel_overhead_s


def optimizer_step_time(parameters_on_rank: float, gpu: Gpu) -> float:
    """AdamW over the parameters a rank updates: memory-bound streaming of its states."""
    return parameters_on_rank * ADAMW_BYTES_PER_PARAM / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


def model_flops_per_step(chain: LayerChain, global_batch_size: int) -> float:
    """Forward + backward FLOPs of one optimizer step, without recomputation."""
    return chain.flops_per_sample * global_batch_size


def mfu(model_flops: float, step_time_s: float, num_gpus: int, gpu: Gpu, train_dtype: str) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the cluster's peak in the training dtype."""
    return model_flops / (step_time_s * num_gpus * peak_flops(gpu, train_dtype))
