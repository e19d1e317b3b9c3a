"""The optimizer train.py runs: torch.optim.AdamW in the implementation the plan names
(Training.optimizer_implementation, torchtitan's optimizer.implementation).

"fused" is one kernel per parameter group that reads each parameter, gradient and both moments once and
writes back the parameter and moments (28 bytes per fp32 parameter, cost/compute.py); torch 2.4+ runs it on
CPU and CUDA and on DTensors. "foreach" batches the per-op kernels over the tensors of a group; "for-loop" is
the single-tensor path. torch's foreach and fused kernels take tensors of one kind per call: a group mixing
DTensors (FSDP2 shards, tensor-parallel weights) with plain tensors fails ("got mixed torch.Tensor and
DTensor"), so the parameters are grouped by kind first.
"""

from __future__ import annotations

from typing import Iterable

import torch

from autoplan.plan import OPTIMIZER_IMPLEMENTATIONS


def adamw(params: Iterable[torch.nn.Parameter], lr: float, implementation: str = "fused", weight_decay: float = 0.01,
          betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW over `params` in `implementation` (one of plan.OPTIMIZER_IMPLEMENTATIONS), one parameter group per tensor kind
    (DTensor or plain), in the parameters' first-seen order; weight decay and betas default to torch's."""
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"optimizer implementation {implementation!r} must be {' | '.join(OPTIMIZER_IMPLEMENTATIONS)}")
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[implementation]
    return torch.optim.AdamW(param_groups(params), lr=lr, weight_decay=weight_decay, betas=tuple(betas), **flags)


def param_groups(params: Iterable[torch.nn.Parameter]) -> list[dict[str, list[torch.nn.Parameter]]]:
    """`params` as optimizer parameter groups, one per tensor kind (DTensor or plain) and device mesh, in first-seen
    order, so torch's foreach and fused optimizers take them (at least one group, possibly empty)."""
    kinds: dict[tuple[str, int], list[torch.nn.Parameter]] = {}
    for p in params:  # DTensors on different meshes (FSDP2's, the expert-parallel experts') apart as well
        kinds.setdefault((type(p.data).__name__, id(getattr(p, "device_mesh", None))), []).append(p)
    return [{"params": group} for group in kinds.values()] or [{"params": []}]
