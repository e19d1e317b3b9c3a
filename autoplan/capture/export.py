"""Capture with torch.export (non-strict) on fake tensors, converted into an OpGraph.

export's training IR keeps ops at the level the user wrote them (aten.linear, aten.layer_norm,
aten.scaled_dot_product_attention) and tags each node with nn_module_stack. Regions under
torch.no_grad() or autocast arrive as higher-order ops with a sub-graph; they are inlined here.
FxConverter also reads the symbolic tracer's graphs (capture/trace.py): the same node kinds, with
no_grad() regions as torch._C._set_grad_enabled calls instead.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from autoplan.capture.fake_model import FakeModel
from autoplan.capture.graph import GraphInput, OpGraph, OpNode, TensorMeta, ValueRef, output_refs, storage_roots
from autoplan.capture.graph import tokens_per_sample as _tokens_per_sample
from autoplan.contract import outputs_without_caches


class CaptureError(Exception):
    """A graph construct this converter does not handle; the caller falls back to another method."""


_INPUT_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}


def module_stack_of(node: fx.Node) -> tuple[str, ...] | None:
    """FQNs of the modules enclosing `node`, outermost first, without the root; None if untagged."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    fqns: list[str] = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if path and (not fqns or fqns[-1] != path):
            fqns.append(path)
    return tuple(fqns)


def _contains_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(value))


def _subgraph_call(node: fx.Node, owner: fx.GraphModule) -> tuple[fx.GraphModule, tuple, bool | None]:
    """(sub-graph, operand nodes, grad mode or None to inherit) of a wrap_* higher-order op."""
    hop = node.target
    if hop is torch.ops.higher_order.wrap_with_set_grad_enabled:
        grad_enabled, submod, *operands = node.args
        return getattr(owner, submod.target), tuple(operands), bool(grad_enabled)
    if hop is torch.ops.higher_order.wrap_with_autocast:
        for position, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                return getattr(owner, arg.target), tuple(node.args[position + 1:]), None
    raise CaptureError(f"unsupported higher-order op {getattr(hop, '__name__', hop)} at node {node.name}")


class FxConverter:
    """Walks an exported graph (and inlined sub-graphs) into OpNodes."""

    def __init__(self) -> None:
        self.nodes: list[OpNode] = []
        self.values: list[tuple[ValueRef, torch.Tensor]] = []
        self.constants: dict[str, GraphInput] = {}

    def run(self, gm: fx.GraphModule, env: dict[fx.Node, Any], prefix: str,
            outer_stack: tuple[str, ...], grad_enabled: bool) -> Any:
        """Convert every node of `gm` (placeholders already bound in env); return the output value."""
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            if node.op == "get_attr":
                env[node] = self._get_attr(gm, node, prefix)
            elif node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                grad_enabled = bool(node.args[0])  # symbolic tracing records no_grad() regions this way
                env[node] = None
            elif node.op == "call_function":
                env[node] = self._call(gm, node, env, prefix, outer_stack, grad_enabled)
            else:
                raise CaptureError(f"unsupported FX node kind {node.op} ({node.name})")
        raise CaptureError("graph has no output node")

    def _get_attr(self, gm: fx.GraphModule, node: fx.Node, prefix: str) -> Any:
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            return value
        name = prefix + node.name
        self.constants[name] = GraphInput(name, "constant", str(node.target), TensorMeta.of(value), False)
        self.values.append((ValueRef(name), value))
        return ValueRef(name)

    def _call(self, gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], prefix: str,
              outer_stack: tuple[str, ...], grad_enabled: bool) -> Any:
        target = node.target
        if target is operator.getitem:
            container, index = node.args
            return env[container][index]
        if isinstance(target, torch._ops.HigherOrderOperator):
            sub, operands, sub_grad = _subgraph_call(node, gm)
            sub_env = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"),
                               (env[o] if isinstance(o, fx.Node) else o for o in operands)))
            stack = module_stack_of(node) or outer_stack
            return self.run(sub, sub_env, f"{prefix}{node.name}_", stack,
                            grad_enabled if sub_grad is None else sub_grad)
        value = node.meta.get("val")
        if not _contains_tensor(value):
            return value  # assertions and symbolic-size arithmetic: no tensor, no cost
        if not isinstance(target, torch._ops.OpOverload):
            raise CaptureError(f"node {node.name} calls {target}, not an ATen op")
        name = prefix + node.name
        refs, tensors = output_refs(name, value)
        self.nodes.append(OpNode(
            name=name,
            target=target,
            args=fx.node.map_arg(node.args, env.__getitem__),
            kwargs=dict(fx.node.map_arg(node.kwargs, env.__getitem__)),
            outputs=tuple(TensorMeta.of(t) for t in tensors),
            module_stack=module_stack_of(node) or outer_stack,
            grad_enabled=grad_enabled,
        ))
        self.values.extend((ValueRef(name, i), t) for i, t in enumerate(tensors))
        return refs


def graph_from_export(ep: ExportedProgram, fake: FakeModel) -> OpGraph:
    """Convert an ExportedProgram of `fake.model` into an OpGraph."""
    signature = ep.graph_signature
    trainable = {name for name, p in fake.model.named_parameters() if p.requires_grad}
    converter = FxConverter()
    inputs: dict[str, GraphInput] = {}
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(signature.input_specs, placeholders):
        kind = _INPUT_KINDS.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported export input kind {spec.kind} ({node.name})")
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            env[node] = value
            continue
        target = fake.canonical_names.get(spec.target, spec.target) if spec.target else node.name
        inputs[node.name] = GraphInput(node.name, kind, target, TensorMeta.of(value),
                                       kind == "parameter" and target in trainable)
        converter.values.append((ValueRef(node.name), value))
        env[node] = ValueRef(node.name)

    flat_outputs = converter.run(ep.graph_module, env, "", (), True)
    user_outputs = [value for spec, value in zip(signature.output_specs, flat_outputs)
                    if spec.kind == OutputKind.USER_OUTPUT]
    outputs = tuple(leaf for leaf in torch.utils._pytree.tree_leaves(user_outputs) if isinstance(leaf, ValueRef))
    inputs.update(converter.constants)
    return OpGraph(
        inputs=inputs,
        nodes=converter.nodes,
        outputs=outputs,
        storage_root=storage_roots(converter.values),
        method="export",
        parameters=fake.trainable_parameters(),
        param_dtype=fake.param_dtype(),
        tokens_per_sample=_tokens_per_sample(fake.first_input(), fake.batch_size),
    )


def capture_export(fake: FakeModel) -> OpGraph:
    """torch.export the forward on fake tensors (raises whatever export raises)."""
    with fake.fake_mode, outputs_without_caches(fake.model):  # as the pipeline's stages are exported
        ep = torch.export.export(fake.model, fake.args, fake.kwargs, strict=False)
    return graph_from_export(ep, fake)
