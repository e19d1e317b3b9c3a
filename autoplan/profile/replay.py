"""Replay one captured op on fresh fake tensors: its FLOPs (forward and backward), which tensors
autograd saves for it, and which outputs require grad.

Results depend only on the op's signature (op, argument shapes/strides/dtypes, which inputs require
grad, non-tensor arguments), so repeated layers are replayed once: a 70B model has ~30 distinct
signatures however many layers it has.
"""

from __future__ import annotations

import dataclasses

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from autoplan.capture.graph import OpGraph, OpNode, ValueRef
from autoplan.chain.ops import counts_flops
from autoplan.profile.flops import register_missing_formulas

log = logging.getLogger(__name__)
aten = torch.ops.aten


@dataclass(frozen=True)
class Slot:
    """Placeholder for the i-th distinct tensor input of an op in a signature's argument template."""

    index: int


@dataclass(frozen=True)
class SlotSpec:
    """How to make the tensor for one slot."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class OpCall:
    """An op with its tensor arguments abstracted to slots: everything a replay needs."""

    target: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    slots: tuple[SlotSpec, ...]
    grad_enabled: bool

    @property
    def key(self) -> tuple:
        """Hashable identity: two calls with equal keys cost the same."""
        return (str(self.target), repr(self.args), repr(self.kwargs), self.slots, self.grad_enabled)

    def materialize(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        fill = lambda leaf: tensors[leaf.index] if isinstance(leaf, Slot) else leaf  # noqa: E731
        return pytree.tree_map(fill, (self.args, self.kwargs))


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd keeps for this op's backward."""

    kind: str
    """"input" (a slot's tensor), "output" (one of the op's outputs) or "internal" (new, e.g. a mask)."""
    index: int
    """Slot index or output index; 0 for internal tensors."""
    nbytes: int
    """Storage bytes (used for internal tensors; inputs and outputs are counted at their producer)."""


@dataclass(frozen=True)
class ReplayResult:
    flops_fwd: float
    flops_bwd: float
    out_requires_grad: tuple[bool, ...]
    saved: tuple[SavedTensor, ...]
    missing_formula: bool
    """A matmul-like op that counted 0 FLOPs: its FLOP formula is missing."""
    error: str | None = None
    """Why the replay failed (then FLOPs are 0 and nothing is saved)."""


def op_call(node: OpNode, graph: OpGraph, requires_grad: dict[ValueRef, bool]) -> tuple[OpCall, list[ValueRef]]:
    """The node as an OpCall, and the ValueRef behind each slot."""
    slot_refs: list[ValueRef] = []
    slot_of: dict[ValueRef, Slot] = {}

    def to_slot(leaf: Any) -> Any:
        if not isinstance(leaf, ValueRef):
            return leaf
        if leaf not in slot_of:
            slot_of[leaf] = Slot(len(slot_refs))
            slot_refs.append(leaf)
        return slot_of[leaf]

    args, kwargs = pytree.tree_map(to_slot, (tuple(node.args), dict(node.kwargs)))
    slots = []
    for ref in slot_refs:
        meta = graph.meta(ref)
        slots.append(SlotSpec(meta.shape, meta.stride, meta.dtype, requires_grad.get(ref, False)))
    return OpCall(node.target, args, kwargs, tuple(slots), node.grad_enabled), slot_refs


def make_inputs(call: OpCall, fill: bool, float_dtype: torch.dtype | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(leaf tensors, tensors to pass) for a call, in the current (fake or real) mode; with `fill`,
    real values (random floats, zero integers, True masks); with `float_dtype`, float32 slots in that dtype
    (an op timed as a bf16 mixed-precision run computes it).

    Leaves that require grad are passed as clones to in-place ops, which may not mutate a leaf."""
    leaves = []
    for spec in call.slots:
        if float_dtype is not None and spec.dtype == torch.float32:
            spec = dataclasses.replace(spec, dtype=float_dtype)
        tensor = _filled(spec) if fill else torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
        leaves.append(tensor.requires_grad_() if spec.requires_grad else tensor)
    if not call.target._schema.is_mutable:
        return leaves, leaves
    return leaves, [t.clone() if t.requires_grad else t for t in leaves]


def _filled(spec: SlotSpec) -> torch.Tensor:
    """A tensor of the slot's layout over a filled storage (expanded, stride-0 layouts included)."""
    empty = any(size == 0 for size in spec.shape)
    storage_numel = 0 if empty else 1 + sum((size - 1) * stride for size, stride in zip(spec.shape, spec.stride))
    base = torch.empty(storage_numel, dtype=spec.dtype)
    if base.is_floating_point() or base.is_complex():
        base.normal_()
    elif base.dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()  # zero is a valid index into any non-empty dimension
    return base.as_strided(spec.shape, spec.stride)


def output_tensors(out: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]


def backward_inputs(leaves: list[torch.Tensor], outputs: list[torch.Tensor]):
    """(outputs that need a gradient, leaves to differentiate, grad_outputs), or None if no backward."""
    differentiable = [t for t in outputs if t.requires_grad]
    wrt = [t for t in leaves if t.requires_grad]
    if not differentiable or not wrt:
        return None
    return differentiable, wrt, [torch.ones_like(t) for t in differentiable]


def _classify_saved(packed: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                    outputs: list[torch.Tensor]) -> tuple[SavedTensor, ...]:
    """Each distinct saved storage as an input slot, an output, or a new internal tensor."""
    slot_by_storage = {StorageWeakRef(t.untyped_storage()): i for tensors in inputs for i, t in enumerate(tensors)}
    output_by_storage = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(outputs)}
    saved, seen = [], set()
    for tensor in packed:
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage in seen:
            continue
        seen.add(storage)
        nbytes = int(tensor.untyped_storage().nbytes())
        if storage in slot_by_storage:
            saved.append(SavedTensor("input", slot_by_storage[storage], nbytes))
        elif storage in output_by_storage:
            saved.append(SavedTensor("output", output_by_storage[storage], nbytes))
        else:
            saved.append(SavedTensor("internal", 0, nbytes))
    return tuple(saved)


def replay_fake(call: OpCall, fake_mode: FakeTensorMode) -> ReplayResult:
    """Run the op forward and backward on fake tensors, counting FLOPs and saved tensors."""
    packed: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor)
        return tensor

    with fake_mode, torch.set_grad_enabled(call.grad_enabled):
        leaves, passed = make_inputs(call, fill=False)
        args, kwargs = call.materialize(passed)
        with FlopCounterMode(display=False) as forward_counter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = call.target(*args, **kwargs)
        outputs = output_tensors(out)
        flops_bwd = 0
        backward = backward_inputs(leaves, outputs)
        if backward is not None:
            differentiable, wrt, grads = backward
            with FlopCounterMode(display=False) as backward_counter:
                torch.autograd.grad(differentiable, wrt, grads, allow_unused=True)
            flops_bwd = backward_counter.get_total_flops()
    flops_fwd = forward_counter.get_total_flops()
    has_elements = any(t.numel() > 0 for t in outputs)
    return ReplayResult(
        flops_fwd=float(flops_fwd),
        flops_bwd=float(flops_bwd),
        out_requires_grad=tuple(t.requires_grad for t in outputs),
        saved=_classify_saved(packed, [leaves, passed], outputs),
        missing_formula=flops_fwd == 0 and has_elements and counts_flops(str(call.target)),
    )


def as_on_accelerator(call: OpCall) -> OpCall:
    """The op as a GPU runs it, where that differs from this CPU in what autograd keeps.

    aten.dropout runs the fused native_dropout kernel on CUDA, which saves a 1-byte boolean mask; on the
    CPU it decomposes into a multiply by a noise tensor of the input's dtype (2-4 bytes per element)."""
    if call.target is aten.dropout.default:
        return OpCall(aten.native_dropout.default, call.args, call.kwargs, call.slots, call.grad_enabled)
    return call


class FakeReplayer:
    """replay_fake with a cache by signature and a shared fake mode. With `accelerator`, ops are
    replayed as a GPU runs them (as_on_accelerator)."""

    def __init__(self, accelerator: bool = False) -> None:
        register_missing_formulas()
        self.fake_mode = FakeTensorMode()
        self.accelerator = accelerator
        self.cache: dict[tuple, ReplayResult] = {}

    def __call__(self, call: OpCall, num_outputs: int) -> ReplayResult:
        key = call.key
        result = self.cache.get(key)
        if result is None:
            try:
                result = replay_fake(as_on_accelerator(call) if self.accelerator else call, self.fake_mode)
            except Exception as e:  # noqa: BLE001 - an op we cannot replay costs 0 FLOPs, not a crash
                message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                log.debug("cannot replay %s: %s", call.target, message)  # listed in ModelProfile.op_failures
                # Without a replay, assume float outputs of an op with a grad-requiring input need grad.
                needs_grad = call.grad_enabled and any(s.requires_grad for s in call.slots)
                result = ReplayResult(0.0, 0.0, (needs_grad,) * num_outputs, (), False, message)
            self.cache[key] = result
        return result
