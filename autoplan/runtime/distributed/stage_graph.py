"""Build one pipeline stage as a GraphModule whose chain modules are submodules it calls.

Inside a stage, the ops of each chain module (e.g. "blocks.3") move into a child GraphModule placed at the
chain module's FQN, and the stage graph calls it. FSDP2 and activation checkpointing work through module
calls (pre-forward hooks), so this keeps per-block sharding and recomputation possible. A chain module
holds the parameters only its ops read; a parameter read by several chain modules or by glue stays on the
stage and is passed to the chain modules as an argument. A chain module whose ops interleave with the rest of the
stage (a module called twice, with other work in between) cannot be one call; it stays inlined.

An experts module exported as one experts_call node (runtime/distributed/expert_calls.py) becomes a call of the model's own
module again, placed at its FQN (relative to the chain module that calls it) with its parameters and buffers
under the model's names, so expert parallelism can shard it and route its tokens. An experts module that is a
chain module itself is that chain module.

A tensor crossing a cut arrives with the strides it had in the exported graph (SendLayout): the sender makes it
contiguous in the order of its strides, the receiver permutes it back (and re-expands broadcast dimensions). The
stage's later ops then see the layout the model produced: a transposed query that reaches attention as a plain
contiguous tensor makes attention's output contiguous in the other order, and the model's `.view` after
`transpose(1, 2)` fails (export records no `.contiguous()` that was a no-op when it traced).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from autoplan.runtime.distributed.expert_calls import called_experts

ROOT = ""
"""Partition name of the stage's own graph (glue between chain modules)."""


@dataclass(frozen=True)
class StateTensor:
    """A parameter, buffer or constant the exported graph reads."""

    fqns: tuple[str, ...]
    """The model's names for it (several for tied weights), the first as named_parameters gives it."""
    value: torch.Tensor
    """The tensor this stage uses (the model's own, or a copy for a later stage of a tied weight)."""
    is_parameter: bool
    key: int
    """Identity of the model tensor it stands for (tied names share a key)."""

    @property
    def fqn(self) -> str:
        return self.fqns[0]

    def name_under(self, prefix: str) -> str | None:
        """The name relative to module `prefix` if one of the tensor's names lies under it."""
        return next((f[len(prefix) + 1:] for f in self.fqns if f.startswith(prefix + ".")), None)


@dataclass(frozen=True)
class SendLayout:
    """How a tensor crosses a cut between stages so that it arrives with the strides the exported graph gave it.

    The pipeline sends contiguous tensors (isend rejects views) into contiguous receive buffers. A tensor is sent
    with each broadcast dimension (stride 0, as `expand` makes) cut to size 1, permuted so that its strides fall
    (then contiguous: no copy for a transposed or permuted tensor, one copy for a slice with gaps), and the
    receiver permutes it back and expands it again: the same shape, the same order of strides."""

    shape: tuple[int, ...]
    """The tensor's shape in the exported graph."""
    expanded: tuple[int, ...]
    """Broadcast dimensions (stride 0, size > 1): sent with size 1, expanded on arrival."""
    order: tuple[int, ...]
    """The dimensions from the largest stride to the smallest: the order they are sent in."""

    @classmethod
    def of(cls, tensor: torch.Tensor) -> SendLayout:
        shape, stride = tuple(int(d) for d in tensor.shape), tuple(int(s) for s in tensor.stride())
        expanded = tuple(d for d, (size, step) in enumerate(zip(shape, stride)) if step == 0 and size > 1)
        order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
        return cls(shape, expanded, order)

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The shape of the contiguous tensor sent (and of the receiver's buffer)."""
        sent = [1 if d in self.expanded else size for d, size in enumerate(self.shape)]
        return tuple(sent[d] for d in self.order)

    def send(self, graph: fx.Graph, node: fx.Node) -> fx.Node:
        for dim in self.expanded:
            node = graph.call_method("narrow", (node, dim, 0, 1))
        if self.order != tuple(range(len(self.order))):
            node = graph.call_method("permute", (node, self.order))
        # contiguous() returns an already contiguous tensor itself: this copies only slices with gaps
        return graph.call_method("contiguous", (node,))

    def receive(self, graph: fx.Graph, node: fx.Node) -> fx.Node:
        if self.order != tuple(range(len(self.order))):
            inverse = tuple(sorted(range(len(self.order)), key=self.order.__getitem__))
            node = graph.call_method("permute", (node, inverse))
        if self.expanded:
            node = graph.call_method("expand", (node, self.shape))
        return node


@dataclass
class StagePlan:
    """What build_stage_module needs to know about one stage."""

    index: int
    """Stage number (names the generated class)."""
    inputs: list[fx.Node]
    """Nodes of the exported graph that arrive as this stage's positional arguments."""
    nodes: list[fx.Node]
    """The ops this stage runs, in graph order."""
    outputs: list[Any]
    """Nodes (or literals) this stage returns, as a tuple."""
    chain_module_of: dict[fx.Node, str | None]
    """Chain module of each op, None for glue."""
    state: dict[fx.Node, StateTensor]
    """Placeholders of parameters/buffers/constants this stage reads."""
    attributes: nn.Module
    """The exported GraphModule (holds subgraphs of higher-order ops, read via get_attr)."""
    experts: dict[str, nn.Module] = field(default_factory=dict)
    """The experts modules the graph's experts_call nodes stand for, by FQN (runtime/distributed/expert_calls.py)."""
    layouts: dict[fx.Node, SendLayout] = field(default_factory=dict)
    """How each tensor this stage receives from, or sends to, another stage travels (the model's inputs, which
    stage 0 takes, and its outputs, which the last stage hands to the loss, are not sent between stages)."""
    constants: dict[fx.Node, Any] = field(default_factory=dict)
    """Values of the exported graph that are Python constants (not tensors): used where they are, never sent."""


def build_stage_module(plan: StagePlan) -> tuple[fx.GraphModule, dict[str, StateTensor], tuple[str, ...]]:
    """The stage module, its state by attribute path, and the chain modules it calls as submodules."""
    chain_module_of = dict(plan.chain_module_of)
    _inline_non_convex_chain_modules(plan, chain_module_of)
    partition = {n: chain_module_of.get(n) or ROOT for n in plan.nodes}
    chain_modules = list(dict.fromkeys(p for p in partition.values() if p != ROOT))
    owner = _state_owners(plan, partition)

    root = nn.Module()
    names: dict[str, StateTensor] = {}
    root_attrs = _AttributeNames(root, names, prefix=ROOT, chain_modules=set(chain_modules))
    graph = fx.Graph()
    env: dict[fx.Node, Any] = dict(plan.constants)
    for node in plan.inputs:
        env[node] = graph.placeholder(node.name)
        if node in plan.layouts:
            env[node] = plan.layouts[node].receive(graph, env[node])
    for node in _inputs_written_in_place(plan):
        env[node] = graph.call_method("clone", (env[node],))

    def value(node: fx.Node) -> fx.Node:
        if node not in env:
            if node in plan.state:
                env[node] = graph.get_attr(root_attrs.name_for(plan.state[node]))
            elif node.op == "get_attr":
                env[node] = graph.get_attr(root_attrs.submodule(node.target, plan.attributes))
        return env[node]

    for item in _item_order(plan, partition):
        if isinstance(item, fx.Node):
            env[item] = _copy_node(graph, item, value, root_attrs, plan)
            continue
        chain_module_nodes = [n for n in plan.nodes if partition[n] == item]
        if [called_experts(n) for n in chain_module_nodes] == [item]:  # the chain module is an experts module
            env[chain_module_nodes[0]] = _copy_node(graph, chain_module_nodes[0], value, root_attrs, plan)
            continue
        module, external, results = _chain_module_module(item, chain_module_nodes, plan, partition, owner, names)
        _set_nested(root, item, module)
        call = graph.call_module(item, tuple(value(n) for n in external))
        for i, result in enumerate(results):
            env[result] = graph.call_function(operator.getitem, (call, i))
    graph.output(tuple(_sent(graph, value(o), o, plan.layouts) for o in plan.outputs))
    return fx.GraphModule(root, graph, class_name=f"Stage{plan.index}"), names, tuple(chain_modules)


def _inputs_written_in_place(plan: StagePlan) -> list[fx.Node]:
    """Stage inputs that an op of the stage writes in place, directly or through a view (`x.masked_fill_`
    in the exported graph). In the whole model such a value was an intermediate; arriving from another
    stage it is a leaf that requires grad, which autograd forbids to write in place, so the stage writes
    a clone (later uses in the stage, and the stage's outputs, read the clone, as they read the written
    value in the whole model)."""
    base = {node: node for node in plan.inputs}
    written = []
    for node in plan.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for argument, value in _schema_arguments(schema, node):
            if not isinstance(value, fx.Node) or value not in base or argument.alias_info is None:
                continue
            if argument.alias_info.is_write:
                written.append(base[value])
            elif any(r.alias_info is not None and r.alias_info.before_set & argument.alias_info.before_set
                     for r in schema.returns):
                base[node] = base[value]
    return list(dict.fromkeys(written))


def _schema_arguments(schema: torch.FunctionSchema, node: fx.Node) -> list[tuple[Any, Any]]:
    """(schema argument, the value the node passes for it) for each argument the node passes."""
    passed = []
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            passed.append((argument, node.args[i]))
        elif argument.name in node.kwargs:
            passed.append((argument, node.kwargs[argument.name]))
    return passed


def _sent(graph: fx.Graph, node: Any, original: Any, layouts: dict[fx.Node, SendLayout]) -> Any:
    """A stage output as it leaves: laid out for the next stage (SendLayout), or, for the model's outputs, as a
    contiguous tensor (contiguous() returns an already contiguous tensor itself)."""
    if not isinstance(original, fx.Node) or not isinstance(original.meta.get("val"), torch.Tensor):
        return node
    if original in layouts:
        return layouts[original].send(graph, node)
    return graph.call_method("contiguous", (node,))


def _inline_non_convex_chain_modules(plan: StagePlan, chain_module_of: dict[fx.Node, str | None]) -> None:
    """Turn chain modules that cannot be a single call (a cycle through other partitions) into glue."""
    while True:
        graph = _item_graph(plan, {n: chain_module_of.get(n) or ROOT for n in plan.nodes})
        try:
            cycle = nx.find_cycle(graph)
        except nx.NetworkXNoCycle:
            return
        chain_module = next(item for edge in cycle for item in edge[:2] if isinstance(item, str))
        for node in plan.nodes:
            if chain_module_of.get(node) == chain_module:
                chain_module_of[node] = None


def _item(node: fx.Node, partition: dict[fx.Node, str]) -> Any:
    """A glue op is its own item; the ops of a chain module form one item (the chain module's name)."""
    return node if partition[node] == ROOT else partition[node]


def _item_graph(plan: StagePlan, partition: dict[fx.Node, str]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for node in plan.nodes:
        graph.add_node(_item(node, partition))
        for inp in node.all_input_nodes:
            if inp in partition and _item(inp, partition) != _item(node, partition):
                graph.add_edge(_item(inp, partition), _item(node, partition))
    return graph


def _item_order(plan: StagePlan, partition: dict[fx.Node, str]) -> list[Any]:
    """Glue ops and chain module calls in a dependency order that stays close to the graph order."""
    first = {}
    for i, node in enumerate(plan.nodes):
        first.setdefault(_item(node, partition), i)
    return list(nx.lexicographical_topological_sort(_item_graph(plan, partition), key=first.__getitem__))


def _state_owners(plan: StagePlan, partition: dict[fx.Node, str]) -> dict[int, str]:
    """Tensor key -> the chain module that alone reads it, else ROOT (the stage passes it to the chain modules)."""
    readers: dict[int, set[str]] = {}
    for node in plan.nodes:
        for inp in node.all_input_nodes:
            if inp in plan.state:
                readers.setdefault(plan.state[inp].key, set()).add(partition[node])
    return {key: parts.pop() if len(parts) == 1 else ROOT for key, parts in readers.items()}


def _chain_module_module(chain_module: str, nodes: list[fx.Node], plan: StagePlan, partition: dict[fx.Node, str],
                 owner: dict[int, str], names: dict[str, StateTensor]):
    """The chain module as a GraphModule, the stage-level nodes it takes, and the nodes it returns."""
    inside = set(nodes)
    container = nn.Module()
    attrs = _AttributeNames(container, names, prefix=chain_module, chain_modules=set())
    graph = fx.Graph()
    local: dict[fx.Node, fx.Node] = {}
    external: list[fx.Node] = []

    def value(node: fx.Node) -> fx.Node:
        if node in local:
            return local[node]
        if node in plan.state and owner[plan.state[node].key] == chain_module:
            local[node] = graph.get_attr(attrs.name_for(plan.state[node]))
        elif node.op == "get_attr":
            local[node] = graph.get_attr(attrs.submodule(node.target, plan.attributes))
        else:
            local[node] = graph.placeholder(node.name)
            external.append(node)
        return local[node]

    for node in nodes:
        local[node] = _copy_node(graph, node, value, attrs, plan)
    stage_outputs = {o for o in plan.outputs if isinstance(o, fx.Node)}
    results = [n for n in nodes if n in stage_outputs or any(u in partition and u not in inside for u in n.users)]
    graph.output(tuple(local[n] for n in results))
    return fx.GraphModule(container, graph, class_name="Chain module"), external, results


def _copy_node(graph: fx.Graph, node: fx.Node, value, attrs: _AttributeNames, plan: StagePlan) -> fx.Node:
    """The node copied into `graph`, or for an experts_call node a call of the experts module it stands for."""
    fqn = called_experts(node)
    if fqn is None:
        return graph.node_copy(node, value)
    path = attrs.module_for(fqn, plan.experts[fqn])
    return graph.call_module(path, tuple(value(a) for a in node.args[:-1]))


class _AttributeNames:
    """Registers state on a module under the model's FQN (relative to the chain module) where possible."""

    def __init__(self, module: nn.Module, names: dict[str, StateTensor], prefix: str, chain_modules: set[str]) -> None:
        self.module, self.names, self.prefix, self.chain_modules = module, names, prefix, chain_modules
        self.by_key: dict[int, str] = {}

    def name_for(self, tensor: StateTensor) -> str:
        if tensor.key in self.by_key:
            return self.by_key[tensor.key]
        if self.prefix:
            name = tensor.name_under(self.prefix) or tensor.fqn.replace(".", "_")
        else:
            name = next((f for f in tensor.fqns if not self._under_chain_module(f)), tensor.fqn.replace(".", "_"))
        while _has_attr(self.module, name):
            name += "_"
        _set_nested(self.module, name, tensor.value)
        self.by_key[tensor.key] = name
        self.names[f"{self.prefix}.{name}" if self.prefix else name] = tensor
        return name

    def module_for(self, fqn: str, module: nn.Module) -> str:
        """Place the model's module `fqn` here (at its name relative to the chain module where possible) and list
        its parameters and buffers under the model's names; returns its path."""
        if self.prefix:
            path = fqn[len(self.prefix) + 1:] if fqn.startswith(self.prefix + ".") else fqn.replace(".", "_")
        else:  # at its FQN unless inside a chain module the stage calls (or it is one: then there)
            path = fqn if fqn in self.chain_modules or not self._under_chain_module(fqn) else fqn.replace(".", "_")
        while _has_attr(self.module, path):
            path += "_"
        _set_nested(self.module, path, module)
        full = f"{self.prefix}.{path}" if self.prefix else path
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            self.names[f"{full}.{name}"] = StateTensor((f"{fqn}.{name}",), tensor,
                                                       is_parameter=isinstance(tensor, nn.Parameter), key=id(tensor))
        return path

    def _under_chain_module(self, fqn: str) -> bool:
        """True if a parent of `fqn` is a chain module submodule here (then the stage cannot use that path)."""
        parts = fqn.split(".")
        return any(".".join(parts[:i]) in self.chain_modules for i in range(1, len(parts) + 1))

    def submodule(self, target: str, source: nn.Module) -> str:
        name = target.replace(".", "_")
        if not _has_attr(self.module, name):
            _set_nested(self.module, name, source.get_submodule(target))
        return name


def _has_attr(module: nn.Module, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True


def _set_nested(module: nn.Module, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    else:
        module.add_module(leaf, value)
