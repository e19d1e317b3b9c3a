"""Dropout switched off for a loss-parity check: `with NoDropout(): ...` makes every dropout the identity.

Why: dropout draws random numbers, and the ranks of a distributed run draw other streams than the
single-device reference, so with dropout their losses differ by far more than float rounding. `autoplan
verify` runs both sides so (runtime/harness/hooks.py's VerifyChecks in train.py, runtime/harness/reference.py's reference);
training itself keeps dropout.

How: a TorchFunctionMode sees every call of a torch function made while it is active, both the
Python-level ones of an eager model (F.dropout, which nn.Dropout calls, and the other dropout functions)
and the aten ops an exported graph calls (a pipeline stage built by runtime.split runs
torch.ops.aten.dropout.default, and native_dropout once decomposed). It answers
  - a dropout call (F.dropout, dropout1d/2d/3d, alpha and feature-alpha dropout, torch.dropout and its
    in-place and feature variants, aten.dropout and kin): with its input, unchanged (native_dropout:
    with a copy of it and an all-true mask);
  - a call with a `dropout_p` argument (F.scaled_dot_product_attention, which Hugging Face attention calls
    with dropout_p > 0 in training, F.multi_head_attention_forward, the aten attention ops): by the same
    call with dropout_p = 0.
Everything else runs as it is.

Backward: a TorchFunctionMode is off while it handles a call, and backward() / autograd.grad are calls it
handles, so the autograd engine runs without it. That matters only where backward runs a forward again:
activation checkpointing. runtime.checkpoint_modules (the plan's recomputation) enters recompute_context()
around each recomputation, which turns dropout off there too while a NoDropout block is active.

Not covered: randomness that is not dropout (torch.bernoulli, rrelu, noise a model draws itself), and the
recomputation of a model's own torch.utils.checkpoint calls (not the plan's), which would draw dropout.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

_TORCH_DROPOUTS = ("dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout", "alpha_dropout_",
                   "feature_alpha_dropout", "feature_alpha_dropout_")
"""torch.* builtins and aten ops taking (input, p, train) that return the input with some elements dropped."""
_ATEN_DROPOUTS = frozenset(_TORCH_DROPOUTS + ("native_dropout",))
_SDPA_ARGUMENTS = (("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
                   {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False})
"""F.scaled_dot_product_attention is a builtin without a Python signature: its argument names and defaults."""


def _python_arguments(func: Callable) -> tuple[tuple[str, ...], dict[str, Any]]:
    parameters = inspect.signature(func).parameters.values()
    return (tuple(p.name for p in parameters),
            {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty})


def _known_functions() -> dict[Any, tuple[tuple[str, ...], dict[str, Any]]]:
    """The Python-level functions handled, with their argument names and defaults."""
    known = {f: _python_arguments(f) for f in (F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d,
                                                F.dropout2d, F.dropout3d, F.multi_head_attention_forward)}
    known.update({getattr(torch, name): (("input", "p", "train"), {}) for name in _TORCH_DROPOUTS})
    known[F.scaled_dot_product_attention] = _SDPA_ARGUMENTS
    return known


def _aten_arguments(op: torch._ops.OpOverload) -> tuple[tuple[str, ...], dict[str, Any]] | None:
    """Argument names and defaults of an aten op that drops out or takes dropout_p, else None."""
    names = tuple(a.name for a in op._schema.arguments)
    if op.namespace != "aten" or (op.overloadpacket.__name__ not in _ATEN_DROPOUTS and "dropout_p" not in names):
        return None
    return names, {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}


class _Call:
    """One call's arguments, looked up by name (positional, keyword or default)."""

    def __init__(self, names: tuple[str, ...], defaults: dict[str, Any], args: tuple, kwargs: dict) -> None:
        self.names, self.defaults, self.args, self.kwargs = names, defaults, args, kwargs

    def get(self, name: str) -> Any:
        index = self.names.index(name)
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, self.defaults.get(name))

    def replaced(self, name: str, value: Any) -> tuple[tuple, dict]:
        """args and kwargs with argument `name` set to `value`."""
        index = self.names.index(name)
        if index < len(self.args):
            return (*self.args[:index], value, *self.args[index + 1:]), self.kwargs
        return self.args, {**self.kwargs, name: value}


class _DropoutOff(TorchFunctionMode):
    def __init__(self, owner: NoDropout, counting: bool = True) -> None:
        super().__init__()
        self.owner, self.counting = owner, counting
        self.known = _known_functions()
        self.aten: dict[torch._ops.OpOverload, tuple | None] = {}

    def _arguments(self, func: Any) -> tuple[tuple[str, ...], dict[str, Any]] | None:
        if isinstance(func, torch._ops.OpOverload):
            if func not in self.aten:
                self.aten[func] = _aten_arguments(func)
            return self.aten[func]
        try:
            return self.known.get(func)
        except TypeError:  # an unhashable callable: not one of ours
            return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arguments = self._arguments(func)
        if arguments is None:
            return func(*args, **kwargs)
        call = _Call(*arguments, args, kwargs)
        if "p" in call.names:
            return self._identity(func, call)
        dropout_p = call.get("dropout_p")
        training = call.get("training") if "training" in call.names else True
        if training and dropout_p:
            self._count()
        args, kwargs = call.replaced("dropout_p", 0.0)
        return func(*args, **kwargs)

    def _count(self) -> None:
        if self.counting:
            self.owner.calls += 1

    def _identity(self, func: Any, call: _Call) -> Any:
        """What a dropout returns with nothing dropped: its input (native_dropout: a copy and an all-true mask)."""
        train = call.get("training") if "training" in call.names else call.get("train")
        if call.get("p") and train is not False:  # native_dropout's train=None means training
            self._count()
        source = call.get(call.names[0])  # "input", or "self" for the in-place aten ops
        if isinstance(func, torch._ops.OpOverload) and func.overloadpacket.__name__ == "native_dropout":
            return source.clone(), torch.ones_like(source, dtype=torch.bool)
        return source


class NoDropout:
    """`with NoDropout(): ...` runs the block with every dropout the identity (see the module docstring);
    `NoDropout(enabled=False)` is a context that changes nothing. `calls` counts the dropout calls it
    disabled (those that would have dropped something: p > 0 in training), over every block it ran."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.calls = 0
        """Dropout calls with p > 0 in training made inside the block, each answered without dropout."""
        self._mode: _DropoutOff | None = None
        self.quiet: _DropoutOff | None = None
        """While entered: the same switch, not counting (recompute_context)."""

    def __enter__(self) -> NoDropout:
        if self.enabled:
            self._mode = _DropoutOff(self)
            self.quiet = _DropoutOff(self, counting=False)
            self._mode.__enter__()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _ACTIVE.remove(self)
            mode.__exit__(*exc)


_ACTIVE: list[NoDropout] = []
"""The NoDropout blocks entered and not yet left, innermost last."""


def recompute_context() -> Any:
    """A context for an activation-checkpointing recomputation (torch.utils.checkpoint's context_fn, second
    element): dropout off while a NoDropout block is active (its calls there are not counted again), else
    nothing. Built when the block is entered: torch.compile traces entering it inside a checkpointed module
    (runtime/distributed/recompute.py), where building it would break the graph."""
    return _ACTIVE[-1].quiet if _ACTIVE else nullcontext()


def attention_without_dropout(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """F.scaled_dot_product_attention's arguments with dropout_p = 0 while a NoDropout block is active (else as
    given), for a call NoDropout's mode does not see: torch.compile traces context parallelism's patched attention
    (runtime/distributed/context_parallel.py) with the model's dropout_p (seen on a GPT with attention dropout at cp=2:
    "aten.add.Tensor got mixed torch.Tensor and DTensor"). Not counted: the reference run counts."""
    if not _ACTIVE:
        return args, kwargs
    return _Call(*_SDPA_ARGUMENTS, args, kwargs).replaced("dropout_p", 0.0)
