"""Synthetic data for the generated program, identical on every rank and in the reference.

At step t every process seeds torch with seed + 1000 + t and calls example_batch(global_batch); a
data-parallel rank keeps its contiguous slice along dim 0. Inputs may be a Tensor, a tuple or a dict
of tensors (called as model(x), model(*x), model(**x)).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from autoplan.errors import UserError

DATA_SEED_OFFSET = 1000
"""Step t draws its batch with seed + DATA_SEED_OFFSET + t, away from the weight-init seed."""


def model_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for calling the model on `inputs`."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    args, kwargs = model_args(inputs)
    return model(*args, **kwargs)


def batch_size_of(tree: Any) -> int:
    sizes = {t.shape[0] for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise UserError(f"example_batch returned tensors with different sizes along dim 0: {sorted(sizes)}")
    return sizes.pop()


def step_batch(example_batch: Callable[[int], Any], global_batch: int, seed: int, step: int) -> tuple[Any, Any]:
    """The whole global batch of step `step`, the same in every process."""
    torch.manual_seed(seed + DATA_SEED_OFFSET + step)
    batch = example_batch(global_batch)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UserError("example_batch(batch_size) must return (inputs, targets)")
    got = batch_size_of(batch)
    if got != global_batch:
        raise UserError(f"example_batch({global_batch}) returned {got} samples along dim 0")
    return batch[0], batch[1]


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
