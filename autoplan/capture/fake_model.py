"""Build the user's model and example batch on fake tensors: shapes and dtypes, no memory.

A 70B-parameter model costs nothing to build this way, which is what lets autoplan plan models that do
not fit on the machine it runs on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autoplan.contract import ModelSource, call_user, disable_kv_cache, raised_in_user_code, user_error, where
from autoplan.errors import UserError


@dataclass
class FakeModel:
    """The model and one example batch of inputs, all on fake tensors of `fake_mode` (real tensors when
    fake_mode is None: see build_real_model)."""

    model: nn.Module
    args: tuple
    """Positional forward arguments."""
    kwargs: dict
    """Keyword forward arguments (a dict batch becomes kwargs)."""
    fake_mode: FakeTensorMode | None
    """The mode the tensors belong to; None when they are real."""
    batch_size: int
    canonical_names: dict[str, str]
    """Every parameter/buffer FQN -> the FQN it is reported under (the first of a tied group)."""

    def trainable_parameters(self) -> dict[str, int]:
        """Trainable parameter FQN -> numel, tied parameters once."""
        return {name: p.numel() for name, p in self.model.named_parameters() if p.requires_grad}

    def state_bytes(self) -> int:
        """Bytes of all parameters and buffers (each shared tensor once)."""
        tensors = {id(t): t for t in chain(self.model.parameters(), self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

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


def build_fake_model(source: ModelSource, batch_size: int) -> FakeModel:
    """Call the user's factory and example_batch under FakeTensorMode."""
    if batch_size < 1:
        raise UserError(f"batch size must be at least 1, got {batch_size}")
    # Tensors created at import time of model.py are real; let them mix with fake ones.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _build_fake(source, fake_mode)
    with fake_mode:
        batch = call_user(source, f"example_batch({batch_size})", source.example_batch, batch_size)
    return _for_training(source, batch_size, model, batch, fake_mode)


def _for_training(source: ModelSource, batch_size: int, model: nn.Module, batch: Any,
                  fake_mode: FakeTensorMode | None) -> FakeModel:
    """Training mode, no KV cache (Hugging Face models return one unless told not to)."""
    if not isinstance(model, nn.Module):
        raise UserError(f"{source.path.name}: {source.factory_name}() must return a torch.nn.Module, "
                        f"got {type(model).__name__}")
    args, kwargs = _split_inputs(source, batch_size, batch)
    kwargs = disable_kv_cache(model, kwargs)
    model.train()
    return FakeModel(model, args, kwargs, fake_mode, batch_size, canonical_names(model))


def _build_fake(source: ModelSource, fake_mode: FakeTensorMode) -> Any:
    """The user's model on fake CPU tensors.

    Some factories cannot run on fake tensors: weight initialization that inspects values
    (nn.init.trunc_normal_'s rejection loop, used by ViT and most vision models), or model.to(dtype),
    which cannot swap a fake parameter in place. Such a factory is retried on the meta device, which
    initializers skip and .to() handles; the meta tensors are then replaced by fake CPU tensors of the
    same layout."""
    what = f"{source.factory_name}()"
    try:
        with fake_mode, initializers_skipped():
            model = source.build_model()
    except UserError:
        raise
    except Exception as fake_error:  # noqa: BLE001 - the user's code: retried, then reported
        try:
            with torch.device("meta"):
                model = source.build_model()
        except UserError:
            raise
        except Exception as meta_error:  # noqa: BLE001
            raise _factory_error(source, what, fake_error, meta_error) from None
        if isinstance(model, nn.Module):
            _to_fake_cpu(model, fake_mode)
    return model


@contextmanager
def initializers_skipped() -> Iterator[None]:
    """torch.nn.init's in-place initializers return their tensor untouched: a fake or meta tensor has no values to
    fill, so skipping them changes nothing the capture sees, and it saves their dispatch through FakeTensorMode
    (about a millisecond per Linear: 0.4 s of a 128-layer GPT's capture). Initializers that inspect values
    (trunc_normal_) then no longer send a factory to the meta-device retry."""
    skipped = {name: fn for name, fn in vars(nn.init).items()
               if callable(fn) and name.endswith("_") and not name.startswith("_")}
    try:
        for name in skipped:
            setattr(nn.init, name, _keep)
        yield
    finally:
        for name, fn in skipped.items():
            setattr(nn.init, name, fn)


def _keep(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    """An initializer that leaves `tensor` as it is."""
    return tensor


NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
"""What fake tensors raise where the code reads a tensor's values (an initializer's rejection loop, .item(),
a shape that depends on values): the factory did nothing wrong, fake tensors have no values."""


def _factory_error(source: ModelSource, what: str, fake_error: Exception, meta_error: Exception) -> UserError:
    """The factory failed on fake tensors and again on the meta device: report the error that is the factory's
    own, not one of the fake tensors'. That is the meta attempt's when the fake one stopped where the code
    reads values (NEEDS_VALUES) or inside a library while the meta one stopped in the user's code; else the
    fake attempt's."""
    meta_is_real = isinstance(fake_error, NEEDS_VALUES) or (
        raised_in_user_code(source, meta_error) and not raised_in_user_code(source, fake_error))
    if not meta_is_real:
        return user_error(source, what, fake_error)
    at = where(source, fake_error)
    return user_error(source, what, meta_error, f"on the meta device; on fake tensors it had stopped earlier"
                                                f"{' at ' + at if at else ''}: {type(fake_error).__name__}")


def _to_fake_cpu(model: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replace every meta or real parameter, buffer and tensor attribute by a fake CPU tensor of the
    same layout (a tensor shared by several modules stays shared)."""
    replaced: dict[int, torch.Tensor] = {}

    def fake_cpu(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in replaced:
            if tensor.is_meta:
                with fake_mode:
                    new = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                                              device="cpu")
            else:
                new = fake_mode.from_tensor(tensor.detach())  # a real tensor the factory made on purpose
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            replaced[id(tensor)] = new
        return replaced[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and not isinstance(tensor, FakeTensor):
                    table[name] = fake_cpu(tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                setattr(module, name, fake_cpu(value))


def build_real_model(source: ModelSource, batch_size: int) -> FakeModel:
    """The user's model and batch on real CPU tensors (random weights): for small models whose forward
    needs tensor values. Allocates the whole model: callers check its size first."""
    model = call_user(source, f"{source.factory_name}()", source.build_model)
    batch = call_user(source, f"example_batch({batch_size})", source.example_batch, batch_size)
    return _for_training(source, batch_size, model, batch, None)
