"""Fits from raw calibration times to hardware-profile numbers (no torch).

Links are fitted to the alpha-beta model of autoplan/cost/comm.py,

    time = latency + bytes x bus_factor / bus_bandwidth,

by least squares on the relative error (so 4 KiB and 16 MiB messages weigh alike), jointly over
all the operations of a tier: the cost model charges every collective and send on a tier with the
same Link. Bus factors are those of nccl-tests (PERFORMANCE.md): all-reduce 2(n-1)/n, all-gather and
reduce-scatter (n-1)/n of the full size, point-to-point 1.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

MIN_EFFICIENCY = 1e-3
"""Smallest efficiency written to a profile (a positive number is required by the loader)."""


def median(values) -> float:
    return float(statistics.median(values))


def bus_factor(op: str, group_size: int) -> float:
    """Bytes each rank moves over its link per byte of message (nccl-tests busbw factors)."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"unknown operation {op!r}")


@dataclass(frozen=True)
class LinkFit:
    """An alpha-beta fit of one link tier."""

    latency_s: float
    """alpha: fixed time per collective or message, seconds (>= 0)."""
    bus_bandwidth_bytes_per_s: float
    """1 / beta: bus bytes per second."""
    relative_rms: float
    """Root mean square of (fitted - measured) / measured over the points used: how well the line fits."""
    points: int
    """Points the fit used (outliers left out)."""


def _weighted_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) minimizing sum(((a + b x - t) / t)^2); a negative a is refitted through zero."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    swx = sum(wi * x for wi, (x, _) in zip(w, points))
    swxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    swt = sum(wi * t for wi, (_, t) in zip(w, points))
    swxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * swxx - swx * swx
    a = (swxx * swt - swx * swxt) / det if det > 0 else 0.0
    b = (sw * swxt - swx * swt) / det if det > 0 else swxt / swxx
    if a < 0:
        a, b = 0.0, swxt / swxx
    if b <= 0:  # times do not grow with size: bandwidth unresolved, bound it by the largest message
        x_max, t_max = max(points)
        b = t_max / x_max
    return a, b


def _relative_residuals(a: float, b: float, points: list[tuple[float, float]]) -> list[float]:
    return [((a + b * x) - t) / t for x, t in points]


OUTLIER_RESIDUAL = 0.5
"""A point whose time is this far off the first fit (relative) and 3x further than the median point
is left out of the second fit: a rank descheduled on a busy machine, not the link."""


def fit_alpha_beta(points: list[tuple[float, float]]) -> LinkFit:
    """Fit (bus bytes = message bytes x bus factor, seconds) points to seconds = a + bus bytes / bw.

    Weighted least squares with weights 1/seconds^2 (relative residuals), fitted twice: the second
    time without outliers (OUTLIER_RESIDUAL), when at least two message sizes remain."""
    points = [(x, t) for x, t in points if t > 0]
    assert len({x for x, _ in points}) >= 2, "an alpha-beta fit needs two message sizes"
    a, b = _weighted_fit(points)
    residuals = [abs(r) for r in _relative_residuals(a, b, points)]
    typical = median(residuals)
    kept = [p for p, r in zip(points, residuals) if r <= max(OUTLIER_RESIDUAL, 3 * typical)]
    if len(kept) < len(points) and len({x for x, _ in kept}) >= 2:
        points = kept
        a, b = _weighted_fit(points)
    residuals = _relative_residuals(a, b, points)
    rms = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    return LinkFit(latency_s=a, bus_bandwidth_bytes_per_s=1.0 / b, relative_rms=rms, points=len(points))


def link_points(seconds: dict[str, dict[int, float]], group_size: int) -> list[tuple[float, float]]:
    """(bus bytes, seconds) of every timed operation of a tier; p2p is always between two ranks."""
    return [(nbytes * bus_factor(op, 2 if op == "p2p" else group_size), t)
            for op, by_size in seconds.items() for nbytes, t in by_size.items()]


@dataclass(frozen=True)
class ThroughputFit:
    """Peaks and the efficiency a profile should carry."""

    peak_flops: dict[str, float]
    """dtype -> peak FLOP/s."""
    matmul_efficiency: float
    memory_bandwidth_bytes_per_s: float
    memory_efficiency: float
    how: str
    """One sentence on where peaks and efficiencies come from (goes into the profile's source)."""


def _efficiency(achieved: float, peak: float) -> float:
    return min(1.0, max(MIN_EFFICIENCY, achieved / peak))


def fit_throughput(matmul: dict[str, dict[int, float]], copy: dict[int, float], primary_dtype: str,
                   typical_sizes: tuple[int, ...], datasheet_peak_flops: dict[str, float] | None = None,
                   datasheet_bandwidth: float | None = None) -> ThroughputFit:
    """Peaks and efficiencies from measured matmul FLOP/s and copy bandwidth.

    With datasheet peaks (GPUs): peaks stay, efficiency = achieved / datasheet peak (at most 1).
    Without (CPU, whose datasheet peak one rank cannot reach): peak = best measured rate of each
    dtype, bandwidth = best measured copy rate (cache-resident sizes), and the efficiencies are
    what planning-typical matmuls (`typical_sizes`) and DRAM-sized copies reach of those peaks."""
    assert primary_dtype in matmul and all(n in matmul[primary_dtype] for n in typical_sizes)
    typical = statistics.fmean(matmul[primary_dtype][n] for n in typical_sizes)
    streaming = copy[max(copy)]
    if datasheet_peak_flops is not None and primary_dtype in datasheet_peak_flops and datasheet_bandwidth:
        return ThroughputFit(
            peak_flops=dict(datasheet_peak_flops),
            matmul_efficiency=_efficiency(typical, datasheet_peak_flops[primary_dtype]),
            memory_bandwidth_bytes_per_s=datasheet_bandwidth,
            memory_efficiency=_efficiency(streaming, datasheet_bandwidth),
            how=(f"peaks from the datasheet profile; matmul_efficiency = measured {primary_dtype} matmul FLOP/s "
                 f"at n={'/'.join(map(str, typical_sizes))} / peak, memory_efficiency = measured copy "
                 f"bandwidth at {max(copy) / 2**20:.0f} MiB / datasheet bandwidth"),
        )
    peaks = {dtype: max(by_size.values()) for dtype, by_size in matmul.items()}
    bandwidth = max(copy.values())
    return ThroughputFit(
        peak_flops=peaks,
        matmul_efficiency=_efficiency(typical, peaks[primary_dtype]),
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_efficiency=_efficiency(streaming, bandwidth),
        how=(f"peaks = best measured matmul FLOP/s per dtype and best copy bandwidth of one rank; "
             f"matmul_efficiency = {primary_dtype} matmuls at n={'/'.join(map(str, typical_sizes))} / peak, "
             f"memory_efficiency = copy bandwidth at {max(copy) / 2**20:.0f} MiB (beyond cache) / peak"),
    )


def op_fits(seconds: dict[str, dict[int, float]], group_size: int) -> dict[str, LinkFit]:
    """Each operation's own alpha-beta fit (what a link's `collectives:` section carries)."""
    return {op: fit_alpha_beta(link_points({op: times}, group_size)) for op, times in seconds.items()}
