"""Calibrate this machine's CPU (2 gloo ranks by default) and print the measured numbers next to the
packaged, uncalibrated profiles/cpu.yaml defaults.

    python benchmarks/calibrate_cpu.py [--nproc 2] [--out cpu-calibrated.yaml]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from autoplan.calibrate import calibrate
from autoplan.hardware.profiles import load_hardware


def rows(measured, packaged):
    """(field, unit, measured, packaged) of every number the planner reads."""
    m, p = measured.gpu, packaged.gpu
    yield "peak fp32", "TFLOP/s", m.peak_flops["fp32"] / 1e12, p.peak_flops["fp32"] / 1e12
    yield "peak bf16", "TFLOP/s", m.peak_flops["bf16"] / 1e12, p.peak_flops["bf16"] / 1e12
    yield "matmul_efficiency", "", m.matmul_efficiency, p.matmul_efficiency
    yield "memory bandwidth", "GB/s", m.memory_bandwidth_bytes_per_s / 1e9, p.memory_bandwidth_bytes_per_s / 1e9
    yield "memory_efficiency", "", m.memory_efficiency, p.memory_efficiency
    yield "kernel overhead", "us", m.kernel_overhead_s * 1e6, p.kernel_overhead_s * 1e6
    yield "memory reserved", "GiB", m.memory_reserved_bytes / 2**30, p.memory_reserved_bytes / 2**30
    for tier in ("intra_node", "inter_node"):
        ml, pl = getattr(measured, tier), getattr(packaged, tier)
        yield f"{tier} bus bandwidth", "GB/s", ml.bus_bandwidth_bytes_per_s / 1e9, pl.bus_bandwidth_bytes_per_s / 1e9
        yield f"{tier} latency", "us", ml.latency_s * 1e6, pl.latency_s * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="keep the profile here (default: a temporary file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "cpu-calibrated.yaml"
        started = time.perf_counter()
        measured = calibrate(out, nproc=args.nproc)
        elapsed = time.perf_counter() - started
        raw = yaml.safe_load(out.read_text())["measurements"]
    packaged = load_hardware("cpu")
    print(f"autoplan calibrate: {args.nproc} ranks in {elapsed:.1f} s on {raw['device_name']}, torch {raw['torch_version']}")
    print(f"{'field':<28}{'unit':<9}{'measured':>12}{'cpu.yaml':>12}{'ratio':>9}")
    for name, unit, value, default in rows(measured, packaged):
        print(f"{name:<28}{unit:<9}{value:>12.4g}{default:>12.4g}{value / default:>9.3g}")
    print("\nmatmul TFLOP/s per n (square, all ranks at once):")
    for dtype, by_n in raw["matmul_tflops"].items():
        print(f"  {dtype:<5}" + "".join(f"{n:>7}: {v:<8.4g}" for n, v in by_n.items()))
    print("copy GB/s per size: " + ", ".join(f"{b / 2**20:g} MiB {v:.4g}" for b, v in raw["copy_gb_per_s"].items()))
    links = raw["links"]["intra_node"]
    print(f"intra-node alpha-beta fit over all ops: {links['fit']}")
    for op, fit in links["per_op_fit"].items():
        times = ", ".join(f"{b // 1024} KiB {t:.4g}" for b, t in links["times_us"][op].items())
        print(f"  {op:<15} latency {fit['latency_us']:.4g} us, busbw {fit['bus_bandwidth_gb_per_s']:.4g} GB/s; us: {times}")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
