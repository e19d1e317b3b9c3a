"""The captured forward graph: ATen ops with module attribution, on fake tensors.

Every capture method (torch.export, symbolic tracing, the dispatch-mode recorder) produces an OpGraph;
profile/ reads only this. Tensors are named by ValueRef (which op, which output), so the same graph can be replayed op
by op on fresh fake or real tensors of the recorded shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class ValueRef:
    """One tensor flowing through the graph: output `index` of op or graph input `node`."""

    node: str
    """Name of the producing op node or graph input."""
    index: int = 0
    """Position among the producer's tensor outputs (flattened)."""


@dataclass(frozen=True)
class TensorMeta:
    """What replaying an op needs to know about a tensor: its layout, not its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int
    """Bytes of the storage the tensor lives in (a view's storage is its base's)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in tensor.shape), tuple(int(s) for s in tensor.stride()),
                          tensor.dtype, int(tensor.untyped_storage().nbytes()))


@dataclass(frozen=True)
class GraphInput:
    """A placeholder of the graph: a parameter, buffer, constant or user input."""

    name: str
    """Placeholder name, unique among nodes and inputs."""
    kind: str
    """"parameter", "buffer", "constant" or "input"."""
    target: str
    """Canonical FQN for parameters and buffers (tied tensors share one), else the placeholder name."""
    meta: TensorMeta
    requires_grad: bool
    """True for trainable parameters."""


@dataclass(frozen=True)
class OpNode:
    """One ATen op call of the forward."""

    name: str
    """Unique node name (the FX node name under export)."""
    target: torch._ops.OpOverload
    args: tuple
    """Positional arguments; tensors replaced by ValueRef (lists of them for list arguments)."""
    kwargs: dict
    """Keyword arguments, tensors replaced by ValueRef."""
    outputs: tuple[TensorMeta, ...]
    """The op's tensor outputs, flattened in pytree order (ValueRef.index counts in this order)."""
    module_stack: tuple[str, ...]
    """Enclosing modules' FQNs, outermost first, without the root."""
    grad_enabled: bool = True
    """False inside torch.no_grad() regions: the op builds no autograd graph."""

    @property
    def module(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    def input_refs(self) -> list[ValueRef]:
        """Every tensor argument, in argument order (with repeats)."""
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return [leaf for leaf in leaves if isinstance(leaf, ValueRef)]


@dataclass
class OpGraph:
    """The captured forward: inputs, ops in execution order, outputs, and which tensors share storage."""

    inputs: dict[str, GraphInput]
    nodes: list[OpNode]
    outputs: tuple[ValueRef, ...]
    storage_root: dict[ValueRef, ValueRef]
    """Each tensor -> the tensor that allocated its storage (itself unless it is a view or alias)."""
    method: str
    """"export", "symbolic_trace" or "dispatch" (see autoplan.capture)."""
    failures: tuple[str, ...] = ()
    """Why earlier capture methods failed, one line each (empty when export worked)."""
    parameters: dict[str, int] = field(default_factory=dict)
    """Trainable parameter FQN -> numel (tied parameters once)."""
    param_dtype: torch.dtype = torch.float32
    """dtype of the model's floating-point parameters."""
    tokens_per_sample: int | None = None
    """Sequence length when the first input is an integer (batch, seq) tensor."""
    mask_skips: tuple[bool, ...] = ()
    """For each attention mask transformers built during the capture, whether it leaves it to SDPA's is_causal when
    the model runs eagerly (capture/masks.py); empty when none was built."""

    node_by_name: dict[str, OpNode] = field(init=False, repr=False)
    """Index of `nodes` by name."""

    def __post_init__(self) -> None:
        self.node_by_name = {node.name: node for node in self.nodes}

    def meta(self, ref: ValueRef) -> TensorMeta:
        if ref.node in self.inputs:
            return self.inputs[ref.node].meta
        return self.node_by_name[ref.node].outputs[ref.index]

    def root_is_state(self, ref: ValueRef) -> bool:
        """True when the tensor's storage belongs to a parameter, buffer or constant (kept anyway)."""
        root = self.storage_root.get(ref, ref)
        graph_input = self.inputs.get(root.node)
        return graph_input is not None and graph_input.kind != "input"


def storage_roots(values: list[tuple[ValueRef, Any]]) -> dict[ValueRef, ValueRef]:
    """Map each tensor to the first tensor (in the given order) that shares its storage."""
    first_by_storage: dict[StorageWeakRef, ValueRef] = {}
    roots: dict[ValueRef, ValueRef] = {}
    for ref, tensor in values:
        if not isinstance(tensor, torch.Tensor):
            continue
        key = StorageWeakRef(tensor.untyped_storage())
        roots[ref] = first_by_storage.setdefault(key, ref)
    return roots


def output_refs(name: str, value: Any) -> tuple[Any, list[torch.Tensor]]:
    """(value with each tensor replaced by ValueRef(name, k), the tensors in that order)."""
    tensors: list[torch.Tensor] = []

    def to_ref(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            return ValueRef(name, len(tensors) - 1)
        return leaf

    return pytree.tree_map(to_ref, value), tensors


def tokens_per_sample(first_input: Any, batch_size: int) -> int | None:
    """Sequence length if the first model input is an integer (batch, seq) tensor of token ids."""
    if isinstance(first_input, torch.Tensor) and first_input.dim() == 2 and not first_input.is_floating_point() \
            and first_input.dtype != torch.bool and first_input.shape[0] == batch_size:
        return int(first_input.shape[1])
    return None
