"""Hardware profiles as YAML (profiles/*.yaml, see profiles_dir()) <-> HardwareProfile.

The YAML carries units in its field names (peak_tflops, memory_gib, bus_bandwidth_gb_per_s, latency_us,
...) so a person can read and edit it; this module converts to the SI units of hardware/types.py
(FLOP/s, bytes, bytes/s, seconds). No torch here: the cost model and solver load profiles too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from autoplan.errors import UserError
from autoplan.hardware.types import DEFAULT_HOST, AlphaBeta, Gpu, HardwareProfile, Host, Link

COLLECTIVE_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
"""Operations a link's optional `collectives:` section may list."""
HOST_OVERHEADS = {"optimizer_tensor_overhead": "compute", "optimizer_dtensor_overhead": "compute",
                  "dtensor_op_overhead": "compute", "fsdp_unit_overhead": "comm", "ddp_tensor_overhead": "comm",
                  "pipeline_microbatch_overhead": "comm"}
"""Optional host-time fields of a profile's gpu section (`NAME_us` in YAML, Gpu.NAME_s, 0 when left
out), each with the side of the time breakdown it is priced in: "compute" (the optimizer, the compute
of tensor-parallel ops) or "comm" (the parts named *comm*: data-parallel and pipeline communication).
`calibrate --refit` scales each with its side's factor."""

TERA = 1e12
"""FLOP/s per TFLOP/s."""
GB = 1e9
"""Bytes per GB (decimal, as bandwidths are quoted)."""
GIB = 2.0**30
"""Bytes per GiB (binary, as memory capacities are)."""
MICRO = 1e-6
"""Seconds per microsecond."""

AUTO_MEMORY = "auto"
"""memory_gib value meaning "half of this machine's RAM, read at load time" (for the cpu profile)."""


def _checkout_profiles() -> Path | None:
    """The top-level profiles/ folder when autoplan runs from its source checkout (an editable install,
    or the checkout on sys.path), else None."""
    root = Path(__file__).resolve().parents[2]
    try:
        ours = 'name = "torch-autoplan"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return root / "profiles" if ours and (root / "profiles").is_dir() else None


def profiles_dir() -> Path:
    """The folder the hardware profiles are read from, by name.

    In a source checkout that is its top-level profiles/ folder, where a user reads them and adds more
    (a file NAME.yaml there is `--gpu NAME`). An installed wheel carries the same files as the package
    autoplan.profiles (pyproject.toml maps that package to the folder profiles/), i.e. autoplan/profiles/
    next to this package."""
    return _checkout_profiles() or Path(__file__).resolve().parent.parent / "profiles"


def known_hardware() -> list[str]:
    """Names of the hardware profiles in profiles_dir(), sorted."""
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def _resolve(name_or_path: str) -> Path:
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path or "/" in name_or_path
    if looks_like_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"hardware profile file not found: {path}")
        return path
    path = profiles_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(f"unknown hardware {name_or_path!r}: known profiles are {', '.join(known_hardware())} "
                        f"(or pass a path to a .yaml file)")
    return path


def half_of_ram_bytes() -> float:
    """Half of this machine's physical memory, bytes (what one process may plan to use by default)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise UserError("cannot read this machine's RAM size: set gpu.memory_gib to a number in the "
                        "hardware profile") from None
    return total / 2


class _Fields:
    """Reads typed fields out of one YAML mapping, naming file and field in every error."""

    def __init__(self, path: Path, raw: Any, prefix: str = "") -> None:
        self.path, self.prefix = path, prefix
        if not isinstance(raw, dict):
            where = f"field '{prefix.rstrip('.')}'" if prefix else "top level"
            raise UserError(f"{path}: {where} must be a mapping of fields, got {type(raw).__name__}")
        self.raw = raw

    def _get(self, key: str) -> Any:
        if key not in self.raw:
            raise UserError(f"{self.path}: missing field '{self.prefix}{key}'")
        return self.raw[key]

    def _bad(self, key: str, wanted: str, value: Any) -> UserError:
        return UserError(f"{self.path}: field '{self.prefix}{key}' must be {wanted}, got {value!r}")

    def number(self, key: str, positive: bool = True, at_most: float | None = None) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, "a number", value)
        if positive and not value > 0:
            raise self._bad(key, "a positive number", value)
        if not positive and value < 0:
            raise self._bad(key, "a non-negative number", value)
        if at_most is not None and value > at_most:
            raise self._bad(key, f"at most {at_most}", value)
        return float(value)

    def optional_number(self, key: str, default: float, at_most: float | None = None) -> float:
        """A non-negative number that may be left out."""
        return self.number(key, positive=False, at_most=at_most) if key in self.raw else default

    def integer(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad(key, "a positive integer", value)
        return value

    def string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise self._bad(key, "a non-empty string", value)
        return value

    def sub(self, key: str) -> "_Fields":
        return _Fields(self.path, self._get(key), f"{self.prefix}{key}.")


def _memory_bytes(gpu: _Fields) -> float:
    if gpu.raw.get("memory_gib") == AUTO_MEMORY:
        return half_of_ram_bytes()
    return gpu.number("memory_gib") * GIB


def _gpu(name: str, gpu: _Fields) -> Gpu:
    peaks = gpu.sub("peak_tflops")
    if not peaks.raw:
        raise UserError(f"{gpu.path}: field 'gpu.peak_tflops' must list at least one dtype (e.g. fp32: 19.5)")
    return Gpu(
        name=name,
        peak_flops={str(dtype): peaks.number(dtype) * TERA for dtype in peaks.raw},
        memory_bytes=_memory_bytes(gpu),
        memory_bandwidth_bytes_per_s=gpu.number("memory_bandwidth_gb_per_s") * GB,
        matmul_efficiency=gpu.number("matmul_efficiency", at_most=1.0),
        memory_efficiency=gpu.number("memory_efficiency", at_most=1.0),
        kernel_overhead_s=gpu.number("kernel_overhead_us", positive=False) * MICRO,
        memory_reserved_bytes=gpu.number("memory_reserved_gib", positive=False) * GIB,
        source=gpu.string("source"),
        comm_overlap=gpu.optional_number("comm_overlap", 1.0, at_most=1.0),
        concurrent_slowdown=max(1.0, gpu.optional_number("concurrent_slowdown", 1.0)),
        pipeline_compute_slowdown=gpu.optional_number("pipeline_compute_slowdown", 0.0),
        **{f"{name}_s": gpu.optional_number(f"{name}_us", 0.0) * MICRO for name in HOST_OVERHEADS},
    )


def _collectives(link: _Fields) -> dict[str, AlphaBeta]:
    if "collectives" not in link.raw:
        return {}
    ops = link.sub("collectives")
    unknown = sorted(set(map(str, ops.raw)) - set(COLLECTIVE_NAMES))
    if unknown:
        raise UserError(f"{link.path}: field '{ops.prefix}{unknown[0]}' is not an operation: use "
                        f"{', '.join(COLLECTIVE_NAMES)}")
    fits = {}
    for op in ops.raw:
        fit = ops.sub(op)
        fits[op] = AlphaBeta(fit.number("latency_us", positive=False) * MICRO, fit.number("bus_bandwidth_gb_per_s") * GB)
    return fits


def _link(link: _Fields) -> Link:
    return Link(
        name=link.string("name"),
        bus_bandwidth_bytes_per_s=link.number("bus_bandwidth_gb_per_s") * GB,
        latency_s=link.number("latency_us", positive=False) * MICRO,
        source=link.string("source"),
        collectives=_collectives(link),
    )


def _host(top: _Fields) -> Host:
    """The optional `host:` section (DEFAULT_HOST when left out)."""
    if "host" not in top.raw:
        return DEFAULT_HOST
    host = top.sub("host")
    return Host(memory_bytes=host.number("memory_gib") * GIB,
                memory_bandwidth_bytes_per_s=host.number("memory_bandwidth_gb_per_s") * GB,
                memory_efficiency=host.number("memory_efficiency", at_most=1.0),
                link_bandwidth_bytes_per_s=host.number("link_bandwidth_gb_per_s", positive=False) * GB,
                source=host.string("source"))


def parse_hardware(text: str, path: Path) -> HardwareProfile:
    """A HardwareProfile from YAML text; `path` names the file in error messages."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: not valid YAML{where}: {problem}") from None
    top = _Fields(path, raw)
    profile = HardwareProfile(
        gpu=_gpu(top.string("name"), top.sub("gpu")),
        intra_node=_link(top.sub("intra_node")),
        inter_node=_link(top.sub("inter_node")),
        default_gpus_per_node=top.integer("default_gpus_per_node"),
        host=_host(top),
    )
    usable = profile.gpu.memory_bytes - profile.gpu.memory_reserved_bytes
    if usable <= 0:
        raise UserError(f"{path}: gpu.memory_reserved_gib ({profile.gpu.memory_reserved_bytes / GIB:.2f} GiB) "
                        f"must be less than gpu.memory_gib ({profile.gpu.memory_bytes / GIB:.2f} GiB)")
    return profile


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A profile by name (a file in profiles_dir(), see known_hardware()) or a .yaml file by path."""
    path = _resolve(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read hardware profile {path}: {e}") from None
    return parse_hardware(text, path)


def link_dict(link: Link) -> dict[str, Any]:
    raw = {
        "name": link.name,
        "bus_bandwidth_gb_per_s": link.bus_bandwidth_bytes_per_s / GB,
        "latency_us": link.latency_s / MICRO,
        "source": link.source,
    }
    if link.collectives:
        raw["collectives"] = {op: {"latency_us": ab.latency_s / MICRO, "bus_bandwidth_gb_per_s": ab.bus_bandwidth_bytes_per_s / GB}
                              for op, ab in link.collectives.items()}
    return raw


def hardware_to_yaml(profile: HardwareProfile) -> str:
    """The YAML text load_hardware reads back into an equal profile (numbers up to float rounding)."""
    gpu = profile.gpu
    raw = {
        "name": gpu.name,
        "default_gpus_per_node": profile.default_gpus_per_node,
        "gpu": {
            "peak_tflops": {dtype: flops / TERA for dtype, flops in gpu.peak_flops.items()},
            "memory_gib": gpu.memory_bytes / GIB,
            "memory_bandwidth_gb_per_s": gpu.memory_bandwidth_bytes_per_s / GB,
            "matmul_efficiency": gpu.matmul_efficiency,
            "memory_efficiency": gpu.memory_efficiency,
            "kernel_overhead_us": gpu.kernel_overhead_s / MICRO,
            "memory_reserved_gib": gpu.memory_reserved_bytes / GIB,
            "comm_overlap": gpu.comm_overlap,
            "concurrent_slowdown": gpu.concurrent_slowdown,
            "pipeline_compute_slowdown": gpu.pipeline_compute_slowdown,
            **{f"{name}_us": getattr(gpu, f"{name}_s") / MICRO for name in HOST_OVERHEADS},
            "source": gpu.source,
        },
        "intra_node": link_dict(profile.intra_node),
        "inter_node": link_dict(profile.inter_node),
        "host": {"memory_gib": profile.host.memory_bytes / GIB,
                 "memory_bandwidth_gb_per_s": profile.host.memory_bandwidth_bytes_per_s / GB,
                 "memory_efficiency": profile.host.memory_efficiency,
                 "link_bandwidth_gb_per_s": profile.host.link_bandwidth_bytes_per_s / GB,
                 "source": profile.host.source},
    }
    header = "# Units are in the field names: tflops = 1e12 FLOP/s, gb = 1e9 bytes, gib = 2**30 bytes, us = 1e-6 s.\n"
    return header + yaml.safe_dump(raw, sort_keys=False)
