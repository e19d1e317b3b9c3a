"""Estimate an op's time on a named accelerator with a roofline: the slower of compute and memory
traffic, plus a fixed launch cost. No torch: works from FLOP and byte counts alone.
"""

from __future__ import annotations

from autoplan.errors import UserError
from autoplan.hardware.types import Gpu


def peak_flops(gpu: Gpu, dtype: str) -> float:
    """Dense peak FLOP/s of `gpu` for dtype key `dtype` ("fp32", "bf16", ...)."""
    if dtype not in gpu.peak_flops:
        raise UserError(f"hardware profile {gpu.name} has no peak FLOP/s for dtype {dtype!r}: "
                        f"it lists {', '.join(sorted(gpu.peak_flops))}")
    return gpu.peak_flops[dtype]


def roofline_seconds(flops: float, bytes_moved: float, gpu: Gpu, dtype: str) -> float:
    """max(flops / achievable FLOP/s, bytes / achievable bandwidth) + kernel_overhead_s."""
    compute_s = flops / (peak_flops(gpu, dtype) * gpu.matmul_efficiency)
    memory_s = bytes_moved / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    return max(compute_s, memory_s) + gpu.kernel_overhead_s


def backward_bytes(input_bytes: int, output_bytes: int, grad_input_bytes: int) -> int:
    """Memory traffic of an op's backward: read the output gradients and the inputs it needs, write
    the input gradients."""
    return output_bytes + input_bytes + grad_input_bytes
