"""Build the user's model and example batch on fake tensors: shapes and dtypes, no memory.

A 70B-parameter model costs nothing to build this way, which is what lets autoplan plan models that do
not fit on the machine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.errors import UserError
from autoplan.source import ModelSource, call_user


@dataclass
class FakeModel:
    """The model and one example batch of inputs, all on fake tensors of `fake_mode`."""

    model: nn.Module
    args: tuple
    """Positional forward arguments."""
    kwargs: dict
    """Keyword forward arguments (a dict batch becomes kwargs)."""
    fake_mode: FakeTensorMode
    batch_size: int
    canonical_names: dict[str, str]
    """Every parameter/buffer FQN -> the FQN it is reported under (the first of a tied group)."""

    def trainable_parameters(self) -> dict[str, int]:
        """Trainable parameter FQN -> numel, tied parameters once."""
        return {name: p.numel() for name, p in self.model.named_parameters() if p.requires_grad}

    def param_dtype(self) -> torch.dtype:
        """dtype of the first floating-point parameter (float32 if there is none)."""
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    def first_input(self) -> Any:
        if self.args:
            return self.args[0]
        return next(iter(self.kwargs.values()), None)


def _split_inputs(source: ModelSource, batch_size: int, batch: Any) -> tuple[tuple, dict]:
    where = f"{source.path.name}: example_batch({batch_size})"
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UserError(f"{where} must return (inputs, targets), got {type(batch).__name__}")
    inputs = batch[0]
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, dict):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise UserError(f"{where}: dict inputs are passed as keyword arguments, so keys must be strings; "
                            f"got {bad[0]!r}")
        return (), dict(inputs)
    raise UserError(f"{where}: inputs must be a Tensor, a tuple of Tensors or a dict of Tensors, "
                    f"got {type(inputs).__name__}")


def canonical_names(model: nn.Module) -> dict[str, str]:
    """FQN -> canonical FQN, where tensors shared under several names map to the first name."""
    first_name_by_id: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, tensor in chain(model.named_parameters(remove_duplicate=False),
                              model.named_buffers(remove_duplicate=False)):
        names[name] = first_name_by_id.setdefault(id(tensor), name)
    return names


def disable_kv_cache(model: nn.Module) -> None:
    """Hugging Face models return a KV cache by default; training (and export) wants none."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def build_fake_model(source: ModelSource, batch_size: int) -> FakeModel:
    """Call the user's factory and example_batch under FakeTensorMode."""
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    # Tensors created at import time of model.py are real; let them mix with fake ones.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        model = call_user(source, f"{source.factory_name}()", source.build_model)
        if not isinstance(model, nn.Module):
            raise UserError(f"{source.path.name}: {source.factory_name}() must return a torch.nn.Module, "
                            f"got {type(model).__name__}")
        batch = call_user(source, f"example_batch({batch_size})", source.example_batch, batch_size)
    args, kwargs = _split_inputs(source, batch_size, batch)
    disable_kv_cache(model)
    model.train()
    return FakeModel(model, args, kwargs, fake_mode, batch_size, canonical_names(model))
