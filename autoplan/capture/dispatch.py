"""Fallback capture: run the forward and record every ATen op a dispatch mode sees.

Works for any model that runs eagerly (the tracers may reject data structures or Python constructs the
forward uses). Ops are recorded below autograd, so composite ops arrive decomposed (aten.linear as
aten.t + aten.addmm). Module attribution comes from forward pre/post hooks on every submodule.
Normally on fake tensors; a small model whose forward needs tensor values (data-dependent control flow,
an op without a fake kernel) is recorded on real tensors instead (see capture_model).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           UnsupportedOperatorException)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.capture.fake_model import FakeModel
from autoplan.capture.graph import GraphInput, OpGraph, OpNode, TensorMeta, ValueRef, output_refs, storage_roots
from autoplan.capture.graph import tokens_per_sample as _tokens_per_sample
from autoplan.errors import UserError
from autoplan.contract import ModelSource, call_user


class _Recorder(TorchDispatchMode):
    """Records each op call with its inputs resolved to the ops (or graph inputs) that produced them."""

    def __init__(self, module_stack: list[str]) -> None:
        super().__init__()
        self.module_stack = module_stack
        self.nodes: list[OpNode] = []
        self.inputs: dict[str, GraphInput] = {}
        self.values: list[tuple[ValueRef, torch.Tensor]] = []
        # id(tensor) -> (tensor, ref); holding the tensor keeps its id from being reused.
        self._refs: dict[int, tuple[torch.Tensor, ValueRef]] = {}
        self._name_counts: Counter[str] = Counter()

    def add_input(self, name: str, kind: str, target: str, tensor: torch.Tensor, requires_grad: bool) -> None:
        self.inputs[name] = GraphInput(name, kind, target, TensorMeta.of(tensor), requires_grad)
        self._bind(tensor, ValueRef(name))

    def _bind(self, tensor: torch.Tensor, ref: ValueRef) -> None:
        self._refs[id(tensor)] = (tensor, ref)
        self.values.append((ref, tensor))

    def ref_of(self, tensor: torch.Tensor) -> ValueRef:
        entry = self._refs.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            return entry[1]
        # A tensor no recorded op produced: a module attribute that is not a buffer, or a global.
        name = f"const_{len(self.inputs)}"
        self.add_input(name, "constant", name, tensor, False)
        return ValueRef(name)

    def _unique_name(self, func: torch._ops.OpOverload) -> str:
        base = func._opname
        count = self._name_counts[base]
        self._name_counts[base] += 1
        return base if count == 0 else f"{base}_{count}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(func, torch._ops.OpOverload):
            return out
        leaves = pytree.tree_leaves(out)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return out
        to_ref = lambda x: self.ref_of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        ref_args, ref_kwargs = pytree.tree_map(to_ref, (args, kwargs))
        name = self._unique_name(func)
        _, tensors = output_refs(name, out)
        self.nodes.append(OpNode(name, func, ref_args, ref_kwargs, tuple(TensorMeta.of(t) for t in tensors),
                                 tuple(self.module_stack), torch.is_grad_enabled()))
        for index, tensor in enumerate(tensors):
            self._bind(tensor, ValueRef(name, index))
        return out


def output_tensors(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """Tensors in a forward's output: pytree leaves, and attributes of plain objects holding them."""
    tensors = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif depth > 0 and hasattr(leaf, "__dict__"):
            tensors.extend(output_tensors(list(vars(leaf).values()), depth - 1))
    return tensors


def attach_module_hooks(model: torch.nn.Module, stack: list[str],
                        on_change: Callable[[], None] | None = None) -> list[Any]:
    """Keep `stack` equal to the FQNs of the modules whose forward is running, calling `on_change`
    after each push and pop (hooks return None so they change neither inputs nor outputs)."""

    def enter(fqn: str) -> None:
        stack.append(fqn)
        if on_change is not None:
            on_change()

    def leave() -> None:
        stack.pop()
        if on_change is not None:
            on_change()

    handles = []
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        handles.append(module.register_forward_pre_hook(lambda _m, _a, fqn=fqn: enter(fqn)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: leave(), always_call=True))
    return handles


class DataDependentError(UserError):
    """The forward needs tensor values (data-dependent control flow or output shapes), which fake
    tensors do not have."""


_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
                   UnsupportedOperatorException)
"""Exceptions that mean "this op needs real values (or a real kernel)", not "the model is wrong"."""


def capture_dispatch(fake: FakeModel, source: ModelSource, failures: tuple[str, ...] = ()) -> OpGraph:
    """Run the forward under the recorder, on fake tensors (or real ones when fake.fake_mode is None).

    A forward that needs tensor values raises DataDependentError; any other failure is the user's
    error (UserError)."""
    stack: list[str] = []
    recorder = _Recorder(stack)
    for name, param in fake.model.named_parameters():
        recorder.add_input(f"p_{name.replace('.', '_')}", "parameter", name, param, param.requires_grad)
    for name, buffer in fake.model.named_buffers():
        recorder.add_input(f"b_{name.replace('.', '_')}", "buffer", name, buffer, False)
    for position, tensor in enumerate(fake.args):
        if isinstance(tensor, torch.Tensor):
            recorder.add_input(f"input_{position}", "input", f"input_{position}", tensor, False)
    for key, tensor in fake.kwargs.items():
        if isinstance(tensor, torch.Tensor):
            recorder.add_input(key, "input", key, tensor, False)

    def forward() -> Any:
        try:
            return fake.model(*fake.args, **fake.kwargs)
        except _DATA_DEPENDENT as e:
            raise DataDependentError(f"the forward needs tensor values: {type(e).__name__}: "
                                     f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None

    handles = attach_module_hooks(fake.model, stack)
    try:
        with fake.fake_mode or contextlib.nullcontext(), recorder:
            out = call_user(source, f"the model's forward on example_batch({fake.batch_size})", forward)
    finally:
        for handle in handles:
            handle.remove()
    outputs = tuple(recorder.ref_of(tensor) for tensor in output_tensors(out))
    return OpGraph(
        inputs=recorder.inputs,
        nodes=recorder.nodes,
        outputs=outputs,
        storage_root=storage_roots(recorder.values),
        method="dispatch",
        failures=failures,
        parameters=fake.trainable_parameters(),
        param_dtype=fake.param_dtype(),
        tokens_per_sample=_tokens_per_sample(fake.first_input(), fake.batch_size),
    )
