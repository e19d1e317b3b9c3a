"""FLOP formulas torch.utils.flop_counter lacks, and which ops ought to have one.

PyTorch counts matmuls, convolutions and the CUDA attention kernels. The CPU attention kernel that
F.scaled_dot_product_attention dispatches to here has no formula, so attention would count 0 FLOPs on
the machine autoplan runs on; we register the same formula the CUDA kernels use.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop_count

aten = torch.ops.aten

_CPU_ATTENTION_FORWARD = [aten._scaled_dot_product_flash_attention_for_cpu]
_CPU_ATTENTION_BACKWARD = [aten._scaled_dot_product_flash_attention_for_cpu_backward]

ATTENTION_BACKWARD_FACTOR = 2
"""Backward FLOPs of attention per forward FLOP: dQ, dK, dV and dP are four matmuls against the
forward's two (Megatron-LM's accounting, which also ignores recomputing the scores)."""


def _attention_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """4 * b * h * s_q * s_k * d: QK^T and PV. Causal masking is counted as full, as Megatron does."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                        **kwargs) -> int:
    return ATTENTION_BACKWARD_FACTOR * sdpa_flop_count(query_shape, key_shape, value_shape)


def register_missing_formulas() -> None:
    """Idempotent: register the CPU attention formulas unless PyTorch already has them."""
    forward = [op for op in _CPU_ATTENTION_FORWARD if op not in flop_registry]
    backward = [op for op in _CPU_ATTENTION_BACKWARD if op not in flop_registry]
    if forward:
        register_flop_formula(forward)(_attention_forward)
    if backward:
        register_flop_formula(backward)(_attention_backward)


_MATMUL_WORDS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "matmul", "linear",
                           "bilinear", "einsum", "tensordot", "attention", "conv", "convolution", "conv1d",
                           "conv2d", "conv3d"})
"""Words of an ATen op name (split at "_") that mark an op whose cost is FLOPs."""


def is_matmul_like(op_name: str) -> bool:
    """True for ops whose cost is FLOPs, so a missing formula matters ("aten.addmm.default")."""
    parts = op_name.split(".")
    packet = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
    return any(word in _MATMUL_WORDS for word in packet.split("_"))
