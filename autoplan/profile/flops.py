"""FLOP formulas torch.utils.flop_counter lacks, and which ops ought to have one.

PyTorch counts matmuls, convolutions and the CUDA attention kernels. The CPU attention kernel that
F.scaled_dot_product_attention dispatches to here has no formula, so attention would count 0 FLOPs on
the machine autoplan runs on; we register the same formula the CUDA kernels use. Likewise for grouped
matmuls (mixture-of-experts layers, including transformers' CPU fallback op) and the matrix-vector
products. Elementwise ops, norms and softmax count 0 FLOPs: their cost is the bytes they move.
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


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Grouped matmul (mixture-of-experts experts): every row of `a` meets one group of `b`, so the
    total is that of one matmul over all rows: 2 * numel(a) * b.shape[-1], whatever the offsets."""
    return 2 * _numel(a_shape) * b_shape[-1]


def _grouped_mm_backward(a_shape, b_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    """Gradients of both operands: two grouped matmuls the size of the forward."""
    return 2 * _grouped_mm(a_shape, b_shape)


def _mv(matrix_shape, vector_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _numel(matrix_shape)


def _addmv(self_shape, matrix_shape, vector_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _numel(matrix_shape)


def _dot(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _numel(a_shape)


def _addbmm(self_shape, batch1_shape, batch2_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _numel(batch1_shape) * batch2_shape[-1]


def _formulas() -> list[tuple[list, object]]:
    """(op packets, formula) pairs; transformers' fallback grouped matmul only if it is registered."""
    pairs = [
        (_CPU_ATTENTION_FORWARD, _attention_forward),
        (_CPU_ATTENTION_BACKWARD, _attention_backward),
        ([aten._grouped_mm], _grouped_mm),
        ([aten.mv], _mv),
        ([aten.addmv], _addmv),
        ([aten.dot, aten.vdot], _dot),
        ([aten.addbmm], _addbmm),
    ]
    try:  # transformers' MoE experts on CPU (integrations/moe.py); exists once transformers is imported
        pairs.append(([torch.ops.transformers.grouped_mm_fallback], _grouped_mm))
        pairs.append(([torch.ops.transformers.grouped_mm_fallback_backward], _grouped_mm_backward))
    except AttributeError:
        pass
    return pairs


def register_missing_formulas() -> None:
    """Idempotent: register our formulas for the ops PyTorch has none for."""
    for ops, formula in _formulas():
        missing = [op for op in ops if op not in flop_registry]
        if missing:
            register_flop_formula(missing)(formula)
