"""Floating-point dtypes the cost model knows: canonical names, element sizes, datasheet peaks."""

from __future__ import annotations

from autoplan.errors import UserError
from autoplan.hardware.types import Gpu

TRAINING_DTYPES = ("fp32", "bf16")
"""dtypes a plan can train in (Training.dtype)."""

_CANONICAL = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp64": "fp64", "float64": "fp64", "double": "fp64", "torch.float64": "fp64",
    "fp8": "fp8", "float8": "fp8",
}

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1}
"""Bytes per element of each canonical floating-point dtype (IEEE 754 / bfloat16 / OCP FP8 formats). fp8 is never a
training dtype: only float8 linears' GEMMs are priced in it (cost/float8.py, priced only)."""


def canonical(dtype: str) -> str:
    """"float32" -> "fp32", "bfloat16" -> "bf16", ...; UserError for a dtype the cost model lacks."""
    name = _CANONICAL.get(dtype.strip().lower())
    if name is None:
        raise UserError(f"unknown floating-point dtype {dtype!r} (known: {', '.join(sorted(_CANONICAL))})")
    return name


def bytes_per_element(dtype: str) -> int:
    return BYTES_PER_ELEMENT[canonical(dtype)]


def training_dtype(dtype: str) -> str:
    """The canonical training dtype, checked against TRAINING_DTYPES."""
    name = canonical(dtype)
    if name not in TRAINING_DTYPES:
        raise UserError(f"training dtype {dtype!r} is not supported (supported: {', '.join(TRAINING_DTYPES)})")
    return name


def activation_scale(capture_dtype: str, train_dtype: str) -> float:
    """Factor from activation bytes at capture to activation bytes when training in `train_dtype`
    (bf16 training of a float32 capture halves them)."""
    return bytes_per_element(train_dtype) / bytes_per_element(capture_dtype)


def peak_flops(gpu: Gpu, dtype: str) -> float:
    """Dense peak FLOP/s of `gpu` in `dtype`, from its hardware profile (keys may be spelled either way)."""
    wanted = canonical(dtype)
    for key, value in gpu.peak_flops.items():
        if _CANONICAL.get(key.strip().lower()) == wanted:
            return float(value)
    raise UserError(
        f"hardware profile {gpu.name!r} has no peak FLOP/s for {wanted} "
        f"(it lists: {', '.join(sorted(gpu.peak_flops)) or 'none'})"
    )
