"""Second capture method: symbolic tracing with proxy tensors (make_fx), without export's checks.

torch.export refuses forwards whose inputs or outputs are not pytrees of tensors (a custom output
class, a cache object), and adds checks of its own on top of tracing. Here the forward is wrapped in a
function of flat tensor lists (parameters and buffers, then the batch's tensors) that returns only the
tensors found in the output, and traced by make_fx at the pre-dispatch level, the IR export itself
produces (aten.linear, aten.scaled_dot_product_attention). Module attribution comes from forward hooks
that note how many graph nodes existed when each module was entered and left.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree

from autoplan.capture.dispatch import attach_module_hooks, output_tensors
from autoplan.capture.export import FxConverter
from autoplan.capture.fake_model import FakeModel
from autoplan.capture.graph import GraphInput, OpGraph, TensorMeta, ValueRef, storage_roots
from autoplan.capture.graph import tokens_per_sample as _tokens_per_sample


class _StackEvents:
    """(number of graph nodes, module stack) each time a module is entered or left while tracing."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.stacks: list[tuple[str, ...]] = []

    def record(self, stack: list[str]) -> None:
        mode = get_proxy_mode()
        if mode is not None:
            self.counts.append(len(mode.tracer.graph.nodes))
            self.stacks.append(tuple(stack))

    def stack_of(self, position: int) -> tuple[str, ...]:
        """Module stack active when the node at `position` (in graph order) was created."""
        index = bisect_right(self.counts, position) - 1
        return self.stacks[index] if index >= 0 else ()


def _input_names(fake: FakeModel) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of the batch: input_<position> for positional arguments (and
    tensors nested in them), the keyword for keyword arguments."""
    named = []
    for position, value in enumerate(fake.args):
        leaves = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        named += [(f"input_{position}" + (f"_{k}" if len(leaves) > 1 else ""), t) for k, t in enumerate(leaves)]
    for key, value in fake.kwargs.items():
        leaves = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        named += [(key + (f"_{k}" if len(leaves) > 1 else ""), t) for k, t in enumerate(leaves)]
    return named


def capture_trace(fake: FakeModel) -> OpGraph:
    """Trace the forward with make_fx on fake tensors (raises whatever tracing raises)."""
    model = fake.model
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    state_names = [name for name, _ in params + buffers]
    leaves, spec = pytree.tree_flatten((fake.args, fake.kwargs))
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def flat_forward(state: list[torch.Tensor], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        filled = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            filled[position] = tensor
        args, kwargs = pytree.tree_unflatten(filled, spec)
        out = torch.func.functional_call(model, dict(zip(state_names, state)), tuple(args), kwargs)
        return output_tensors(out)

    events = _StackEvents()
    stack: list[str] = []
    handles = attach_module_hooks(model, stack, on_change=lambda: events.record(stack))
    try:
        with fake.fake_mode:
            gm = make_fx(flat_forward, tracing_mode="fake", pre_dispatch=True)(
                [t for _, t in params + buffers], [leaves[i] for i in tensor_positions])
    finally:
        for handle in handles:
            handle.remove()
    return _graph_from_trace(gm, fake, params, buffers, events)


def _graph_from_trace(gm: fx.GraphModule, fake: FakeModel, params: list, buffers: list,
                      events: _StackEvents) -> OpGraph:
    for position, node in enumerate(gm.graph.nodes):
        stack = events.stack_of(position)
        if stack:
            node.meta["nn_module_stack"] = {fqn: (fqn, "") for fqn in stack}
    kinds = [("parameter", name, p.requires_grad) for name, p in params]
    kinds += [("buffer", name, False) for name, _ in buffers]
    kinds += [("input", name, False) for name, _ in _input_names(fake)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    converter = FxConverter()
    inputs: dict[str, GraphInput] = {}
    env: dict[fx.Node, Any] = {}
    node_names = {n.name for n in gm.graph.nodes}
    for (kind, target, requires_grad), node in zip(kinds, placeholders):
        value = node.meta["val"]
        # a batch tensor is named by its argument, unless an op node already has that name
        name = target if kind == "input" and target not in node_names else node.name
        target = fake.canonical_names.get(target, target)
        inputs[name] = GraphInput(name, kind, target, TensorMeta.of(value), requires_grad)
        converter.values.append((ValueRef(name), value))
        env[node] = ValueRef(name)
    flat_outputs = converter.run(gm, env, "", (), True)
    inputs.update(converter.constants)
    return OpGraph(
        inputs=inputs,
        nodes=converter.nodes,
        outputs=tuple(leaf for leaf in pytree.tree_leaves(flat_outputs) if isinstance(leaf, ValueRef)),
        storage_root=storage_roots(converter.values),
        method="symbolic_trace",
        parameters=fake.trainable_parameters(),
        param_dtype=fake.param_dtype(),
        tokens_per_sample=_tokens_per_sample(fake.first_input(), fake.batch_size),
    )
