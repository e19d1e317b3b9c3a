"""Measurements -> a hardware profile YAML in the format of profiles/ (no torch).

The profile's fields are what the planner reads; the raw measurements go under a top-level
`measurements:` key, which load_hardware ignores, so a person can see what the fit was made from.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from autoplan.calibrate.fit import LinkFit, fit_alpha_beta, fit_throughput, link_points, op_fits
from autoplan.calibrate.types import ROUNDS, SIZES, Measurements, TierTimes
from autoplan.errors import UserError
from autoplan.hardware.profiles import (AUTO_MEMORY, GB, GIB, HOST_OVERHEADS, MICRO, TERA, link_dict,
                                       parse_hardware)
from autoplan.hardware.types import HardwareProfile

UNITS_COMMENT = "# Units are in the field names: tflops = 1e12 FLOP/s, gb = 1e9 bytes, gib = 2**30 bytes, us = 1e-6 s."

CUDA_PROFILES = ((r"h200", "h200-sxm-141gb"), (r"h100", "h100-sxm5-80gb"), (r"a100.*80\s*gb", "a100-sxm4-80gb"),
                 (r"a100", "a100-sxm4-40gb"), (r"v100", "v100-sxm2-32gb"), (r"\bl4\b", "l4"))
"""torch.cuda.get_device_name() pattern (lower case) -> packaged profile with the datasheet peaks."""


def default_base(device: str, device_name: str) -> str | None:
    """The packaged profile to start from: "cpu" on the CPU, the matching GPU profile on CUDA, else None
    (then peaks are the best measured rates, as on the CPU)."""
    if device == "cpu":
        return "cpu"
    for pattern, profile in CUDA_PROFILES:
        if re.search(pattern, device_name.lower()):
            return profile
    return None


def _round(x: float) -> float:
    """4 significant digits: what a measurement is worth, and readable."""
    return float(f"{x:.4g}")


def _tier_fit(tier: TierTimes) -> LinkFit:
    return fit_alpha_beta(link_points(tier.seconds, tier.group_size))


def _link(name: str, fit: LinkFit, source: str, tier: TierTimes) -> dict[str, Any]:
    """The link's joint fit, and each operation's own (the cost model prices each with its own)."""
    per_op = op_fits(tier.seconds, tier.group_size)
    return {"name": name, "bus_bandwidth_gb_per_s": _round(fit.bus_bandwidth_bytes_per_s / GB),
            "latency_us": _round(fit.latency_s / MICRO), "source": source,
            "collectives": {op: {"latency_us": _round(f.latency_s / MICRO),
                                 "bus_bandwidth_gb_per_s": _round(f.bus_bandwidth_bytes_per_s / GB)}
                            for op, f in per_op.items()}}


def _link_source(found: Measurements, tier: str, fit: LinkFit) -> str:
    times = found.tiers[tier]
    sizes = sorted(times.seconds["all_reduce"])
    text = (f"autoplan calibrate {found.date}: {found.backend} all-reduce, all-gather, reduce-scatter and p2p "
            f"among {times.group_size} ranks, {sizes[0] // 1024} KiB-{sizes[-1] // 2**20} MiB, alpha-beta "
            f"least-squares fit with nccl-tests bus factors ({fit.points} points after outliers, relative rms "
            f"{fit.relative_rms:.0%})")
    if times.copied_from == "intra_node":
        text += "; copied from intra_node: calibrated on one node, inter-node links not measured"
    elif times.copied_from:
        text += "; copied from inter_node: one rank per node, intra-node links not measured"
    return text


HOST_FIELDS = (  # YAML field, attribute (Measurements and Gpu alike), default without a base, YAML unit
    ("comm_overlap", "comm_overlap", 1.0, 1.0),
    ("concurrent_slowdown", "concurrent_slowdown", 1.0, 1.0),
    ("pipeline_compute_slowdown", "pipeline_compute_slowdown", 0.0, 1.0),
    *((f"{name}_us", f"{name}_s", 0.0, MICRO) for name in HOST_OVERHEADS),
)
"""Overlap and host overheads a calibration measures into the profile's gpu section."""


def _host_fields(found: Measurements, base: HardwareProfile | None) -> dict[str, Any]:
    """Overlap and host overheads: measured where the run measured them, else the base profile's."""
    fields = {}
    for name, attribute, default, unit in HOST_FIELDS:
        value = getattr(found, attribute)
        if value is None:
            value = getattr(base.gpu, attribute) if base else default
        fields[name] = _round(value / unit)
    return fields


def profile_fields(found: Measurements, base: HardwareProfile | None) -> dict[str, Any]:
    """The profile's fields (YAML units) from measurements; `base` supplies datasheet peaks (GPUs),
    link names and, on the CPU, the node size."""
    sizes = SIZES[found.device]
    primary = sizes.primary_dtype if sizes.primary_dtype in found.matmul_flops_per_s else next(iter(found.matmul_flops_per_s))
    typical = tuple(n for n in sizes.typical_sizes if n in found.matmul_flops_per_s[primary])
    datasheet = base is not None and base.gpu.name != "cpu"
    fit = fit_throughput(found.matmul_flops_per_s, found.copy_bytes_per_s, primary, typical or sizes.matmul_sizes[-1:],
                         base.gpu.peak_flops if datasheet else None,
                         base.gpu.memory_bandwidth_bytes_per_s if datasheet else None)
    if found.device == "cpu":
        memory: Any = AUTO_MEMORY
        reserved, reserved_how = found.resident_bytes, "resident set of a rank after start-up (torch, gloo)"
    else:
        memory = _round(found.device_memory_bytes / GIB)
        measured = found.resident_bytes
        reserved = max(measured, base.gpu.memory_reserved_bytes) if base else measured
        reserved_how = (f"max(measured CUDA context + NCCL/cuBLAS memory {measured / GIB:.2f} GiB, "
                        f"the base profile's allowance)" if base else "measured CUDA context + NCCL/cuBLAS memory")
    name = base.gpu.name if base else re.sub(r"[^a-z0-9]+", "-", found.device_name.lower()).strip("-")
    between = (f"dtensor_op_overhead = a tensor-parallel MLP's "
               f"forward+backward over its plain local shard's, less two modeled all-reduces, per DTensor op "
               f"counted; optimizer_dtensor_overhead = AdamW step time per sharded DTensor; fsdp_unit_overhead = fully_shard's extra time "
               f"per unit of two transformer layers, less its modeled collectives; ddp_tensor_overhead = "
               f"DistributedDataParallel's extra step time over two transformer layers, less their modeled "
               f"gradient all-reduce, per parameter tensor; pipeline_microbatch_overhead "
               f"+ pipeline_compute_slowdown x the stage's compute = the time per stage and micro-batch that makes "
               f"the simulated GPipe step of stages of one transformer layer last as measured, fitted per (stage "
               f"alone, pipelined) pair at two micro-batch sizes, a line through the two; the wrapped-vs-"
               f"plain differences are medians of back-to-back pairs; "
               f"comm_overlap = share of an all-reduce hidden by matmuls run beside it; these framework probes "
               f"and comm_overlap are medians of {ROUNDS} rounds taken in turns; "
               f"concurrent_slowdown = a transformer layer's step on all ranks at once over rank 0 alone")
    if found.links_not_measured:
        between = (f"comm_overlap, concurrent_slowdown and the host overheads of DDP, FSDP2, DTensor and pipelining "
                   f"are the base profile's, not measured ({found.links_not_measured})")
    gpu_source = (f"autoplan calibrate {found.date} on {found.device_name}, torch {found.torch_version}, "
                  f"{found.world_size} {found.backend} rank(s) x {found.threads_per_rank} thread(s): {fit.how}; "
                  f"kernel_overhead = median time of a 1-element add; optimizer_tensor_overhead = AdamW step time per "
                  f"one-element tensor; {between}; "
                  f"memory_reserved = {reserved_how}")
    return {
        "name": name,
        "default_gpus_per_node": found.devices_per_node or (base.default_gpus_per_node if base else found.ranks_per_node),
        "gpu": {
            "peak_tflops": {dtype: _round(flops / TERA) for dtype, flops in fit.peak_flops.items()},
            "memory_gib": memory,
            "memory_bandwidth_gb_per_s": _round(fit.memory_bandwidth_bytes_per_s / GB),
            "matmul_efficiency": _round(fit.matmul_efficiency),
            "memory_efficiency": _round(fit.memory_efficiency),
            "kernel_overhead_us": _round(found.kernel_overhead_s / MICRO),
            "memory_reserved_gib": _round(reserved / GIB),
            **_host_fields(found, base),
            "source": gpu_source,
        },
        **_links(found, base, datasheet),
    }


def _links(found: Measurements, base: HardwareProfile | None, datasheet: bool) -> dict[str, Any]:
    """The intra_node and inter_node sections: fitted to the measured tiers, or, when the run measured no
    link (one rank), the base profile's, their source saying so."""
    if found.links_not_measured:
        if base is None:
            raise UserError(f"calibrate measured no link ({found.links_not_measured}) and no base profile "
                            f"supplies them for {found.device_name}: pass --gpu NAME or --hardware FILE whose links "
                            f"to keep")
        return {tier: {**link_dict(getattr(base, tier)),
                       "source": f"not measured by autoplan calibrate {found.date} ({found.links_not_measured}); "
                                 f"kept from profile {base.gpu.name}: {getattr(base, tier).source}"}
                for tier in ("intra_node", "inter_node")}
    intra_fit, inter_fit = _tier_fit(found.tiers["intra_node"]), _tier_fit(found.tiers["inter_node"])
    intra_name = base.intra_node.name if base else "intra-node"
    inter_name = intra_name if found.tiers["inter_node"].copied_from else (base.inter_node.name if datasheet else "network")
    if found.tiers["intra_node"].copied_from:
        intra_name = inter_name
    return {"intra_node": _link(intra_name, intra_fit, _link_source(found, "intra_node", intra_fit),
                                found.tiers["intra_node"]),
            "inter_node": _link(inter_name, inter_fit, _link_source(found, "inter_node", inter_fit),
                                found.tiers["inter_node"])}


def measurements_fields(found: Measurements, base_label: str | None) -> dict[str, Any]:
    """The raw numbers, for people (load_hardware ignores this section)."""
    links = {}
    for tier_name, tier in found.tiers.items():
        fit = _tier_fit(tier)
        per_op = op_fits(tier.seconds, tier.group_size)
        links[tier_name] = {
            "group_size": tier.group_size,
            **({"copied_from": tier.copied_from} if tier.copied_from else {}),
            "fit": {"latency_us": _round(fit.latency_s / MICRO),
                    "bus_bandwidth_gb_per_s": _round(fit.bus_bandwidth_bytes_per_s / GB),
                    "relative_rms": _round(fit.relative_rms), "points_used": fit.points,
                    "points": sum(len(times) for times in tier.seconds.values())},
            "per_op_fit": {op: {"latency_us": _round(f.latency_s / MICRO),
                                "bus_bandwidth_gb_per_s": _round(f.bus_bandwidth_bytes_per_s / GB)}
                           for op, f in per_op.items()},
            "times_us": {op: {nbytes: _round(t / MICRO) for nbytes, t in sorted(times.items())}
                         for op, times in tier.seconds.items()},
        }
    fields: dict[str, Any] = {
        "date": found.date,
        "torch_version": found.torch_version,
        "device": found.device,
        "device_name": found.device_name,
        "backend": found.backend,
        "world_size": found.world_size,
        "ranks_per_node": found.ranks_per_node,
        "threads_per_rank": found.threads_per_rank,
        "base_profile": base_label or "none (peaks measured)",
        "matmul_tflops": {dtype: {n: _round(r / TERA) for n, r in sorted(by_n.items())}
                          for dtype, by_n in found.matmul_flops_per_s.items()},
        "copy_gb_per_s": {nbytes: _round(r / GB) for nbytes, r in sorted(found.copy_bytes_per_s.items())},
        "kernel_overhead_us": _round(found.kernel_overhead_s / MICRO),
        "resident_gib": _round(found.resident_bytes / GIB),
        "links": links or f"not measured: {found.links_not_measured}",
    }
    if found.device_memory_bytes is not None:
        fields["device_memory_gib"] = _round(found.device_memory_bytes / GIB)
    if found.peak_allocated_bytes is not None:
        fields["peak_allocated_gib"] = _round(found.peak_allocated_bytes / GIB)
    fields.update({key: _round(value) for key, value in found.extra.items()})
    return fields


def profile_text(header: list[str], raw: dict[str, Any]) -> str:
    """YAML text: comment lines, then the fields in the order given."""
    lines = [line if line.startswith("#") else f"# {line}" for line in header]
    return "\n".join(lines) + "\n" + yaml.safe_dump(raw, sort_keys=False, width=120)


def write_checked(path: Path, text: str) -> HardwareProfile:
    """Parse `text` as a hardware profile (so nothing unloadable is written), then write it atomically."""
    profile = parse_hardware(text, path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(staging, 0o644)  # mkstemp creates 0600; a profile is meant to be shared
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return profile


def write_profile(found: Measurements, out: Path, base: HardwareProfile | None, base_label: str | None) -> HardwareProfile:
    """Write the calibrated profile of `found` to `out`."""
    if found.device not in SIZES:
        raise UserError(f"cannot calibrate device {found.device!r}: only cpu and cuda are supported")
    raw = profile_fields(found, base)
    raw["measurements"] = measurements_fields(found, base_label)
    header = [
        f"# Calibrated by `autoplan calibrate` on {found.date}: {found.world_size} {found.backend} ranks "
        f"({found.ranks_per_node} per node) on {found.device_name}, torch {found.torch_version}.",
        f"# Started from profile: {base_label or 'none'}. Each number's origin is in the `source` fields; the raw",
        "# timings are under `measurements:` (not read by the planner). Plan with: autoplan MODEL.py --hardware THIS.yaml",
    ]
    if found.links_not_measured:
        header.append(f"# intra_node and inter_node are the base profile's, not measured: {found.links_not_measured}.")
    elif found.tiers["inter_node"].copied_from:
        header.append("# inter_node is a copy of intra_node: all ranks ran on one node, so no inter-node link was measured.")
    if not found.links_not_measured and found.tiers["intra_node"].copied_from:
        header.append("# intra_node is a copy of inter_node: one rank per node, so no intra-node link was measured.")
    return write_checked(out, profile_text(header + [UNITS_COMMENT], raw))
