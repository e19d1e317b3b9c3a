"""A batch as the plan divides it: its size, a data-parallel rank's slice, micro-batches, on a device. A batch is a
Tensor, a tuple or a dict of tensors (pytree leaves); each tensor is split along dim 0."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from autoplan.errors import UserError


def batch_size_of(tree: Any) -> int:
    sizes = {t.shape[0] for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise UserError(f"example_batch returned tensors with different sizes along dim 0: {sorted(sizes)}")
    return sizes.pop()


def shard(tree: Any, index: int, count: int) -> Any:
    """Slice `index` of `count` contiguous equal slices along dim 0 of every tensor in `tree`."""
    def take(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % count:
            raise UserError(f"cannot split {t.shape[0]} samples into {count} equal parts")
        size = t.shape[0] // count
        return t.narrow(0, index * size, size)
    return pytree.tree_map(take, tree)


def microbatches(tree: Any, count: int) -> list[Any]:
    """`count` equal contiguous micro-batches of a batch (gradient accumulation)."""
    return [shard(tree, i, count) for i in range(count)]


def to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)
