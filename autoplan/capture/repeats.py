"""Capture a stack of identical blocks once: trace three of them, replicate the last for the rest.

An 80-layer transformer is 80 copies of one block; tracing all of them is most of the capture time of a
large model. A run of identical, consecutive blocks in a ModuleList or Sequential (same class, same
parameter shapes, same settings apart from a layer index) is cut down to its first three blocks while
tracing. The third block's ops (and any glue ops up to where the next block would start) then form a
template, cloned once per removed block with names, modules and parameters renamed and its inputs
re-wired: a reference to the second block's values becomes one to the previous clone's, and everything
after the run reads from the last clone. The three traced blocks must produce the same op sequence (so
the parent's loop treats them alike), and a block may read only the previous one, or the model is
captured whole instead. Not seen: a parent loop that treats every k-th block differently for k > 2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.fx.immutable_collections import immutable_list

from autoplan.capture.graph import GraphInput, OpGraph, OpNode, ValueRef

KEPT_BLOCKS = 3
"""Blocks of a run that are traced: the third is the template, and the first two check that every
block (with whatever glue the parent's loop adds) runs the same ops."""
MIN_RUN_LENGTH = 5
"""Shorter runs are captured whole: cutting them saves little."""
_PRIMITIVES = (bool, int, float, str, type(None))


class RepeatError(Exception):
    """The traced blocks do not line up; the caller captures the model whole instead."""


@dataclass(frozen=True)
class Run:
    """Blocks start..stop-1 of the container at `container` are identical."""

    container: str
    """FQN of the ModuleList or Sequential."""
    keys: tuple[str, ...]
    """The container's child names (its _modules keys), in order."""
    start: int
    stop: int

    def block(self, position: int) -> str:
        return f"{self.container}.{self.keys[position]}"


def _signature(block: nn.Module) -> dict[str, Any]:
    """What must agree between two blocks for them to run the same ops: module classes, parameter and
    buffer layouts, and plain settings (numbers, strings, flags) of every submodule."""
    signature: dict[str, Any] = {}
    for name, module in block.named_modules():
        signature[f"{name}:class"] = type(module).__qualname__
        for key, value in vars(module).items():
            if not key.startswith("_") and isinstance(value, _PRIMITIVES):
                signature[f"{name}:{key}"] = value
        for key, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                signature[f"{name}:{key}"] = (tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
    return signature


def _same_block(previous: dict[str, Any], current: dict[str, Any]) -> bool:
    """Equal signatures, except integers that count up by one from block to block (a layer index)."""
    if previous.keys() != current.keys():
        return False
    return all(a == b or (type(a) is int and type(b) is int and b == a + 1)
               for a, b in ((previous[k], current[k]) for k in previous))


def find_runs(model: nn.Module) -> list[Run]:
    """Runs of at least MIN_RUN_LENGTH identical consecutive blocks, outermost containers first."""
    runs: list[Run] = []
    for fqn, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < MIN_RUN_LENGTH:
            continue
        if any(fqn.startswith(run.container + ".") for run in runs):
            continue  # inside a block that is already being replicated
        blocks = list(container._modules.values())
        if len({id(b) for b in blocks}) != len(blocks):
            continue  # one module reused: its parameters are shared, not repeated
        signatures = [_signature(b) for b in blocks]
        start = 0
        for position in range(1, len(blocks) + 1):
            if position == len(blocks) or not _same_block(signatures[position - 1], signatures[position]):
                if position - start >= MIN_RUN_LENGTH:
                    runs.append(Run(fqn, tuple(container._modules), start, position))
                start = position
    return runs


@contextlib.contextmanager
def truncated(model: nn.Module, runs: list[Run]) -> Iterator[None]:
    """Within the block, each run keeps only its first KEPT_BLOCKS blocks (child names unchanged)."""
    saved = []
    for run in runs:
        container = model.get_submodule(run.container)
        saved.append((container, container._modules))
        removed = set(run.keys[run.start + KEPT_BLOCKS:run.stop])
        container._modules = {k: m for k, m in container._modules.items() if k not in removed}
    try:
        yield
    finally:
        for container, modules in saved:
            container._modules = modules


def _in_block(node: OpNode, block: str) -> bool:
    return any(m == block or m.startswith(block + ".") for m in node.module_stack)


def _op_signature(node: OpNode) -> tuple:
    strip = lambda leaf: "ref" if isinstance(leaf, ValueRef) else leaf  # noqa: E731
    args, kwargs = torch.utils._pytree.tree_map(strip, (node.args, node.kwargs))
    return str(node.target), repr(args), repr(kwargs), node.outputs, node.grad_enabled


def _rename_module(fqn: str, old: str, new: str) -> str:
    return new + fqn[len(old):] if fqn == old or fqn.startswith(old + ".") else fqn


def _periods(nodes: list[OpNode], run: Run) -> tuple[list[OpNode], list[OpNode], int]:
    """(second block's period, third block's period, index after the third) of a graph traced with
    KEPT_BLOCKS blocks; a period runs from a block's first op to the next block's first op."""
    blocks = [run.block(run.start + k) for k in range(KEPT_BLOCKS)]
    starts = [next((i for i, n in enumerate(nodes) if _in_block(n, b)), None) for b in blocks]
    if None in starts or sorted(starts) != starts or starts[0] == starts[1]:
        raise RepeatError(f"the ops of {', '.join(blocks)} do not run in order")
    period = starts[1] - starts[0]
    periods = [nodes[start:start + period] for start in starts]
    signatures = [[_op_signature(n) for n in nodes_of_period] for nodes_of_period in periods]
    if starts[2] - starts[1] != period or any(s != signatures[0] for s in signatures[1:]):
        raise RepeatError(f"{', '.join(blocks)} ran different ops")
    end = starts[2] + period
    if any(_in_block(n, b) for n in nodes[end:] for b in blocks):
        raise RepeatError(f"ops of {blocks[-1]} continue after its period")
    older = {n.name for n in periods[0]}
    if any(ref.node in older for n in periods[2] for ref in n.input_refs()):
        raise RepeatError(f"{blocks[-1]} reads values of {blocks[0]}: blocks depend on more than the previous one")
    return periods[1], periods[2], end


def expand(graph: OpGraph, run: Run) -> OpGraph:
    """The graph of the whole run, from a graph traced with only its first KEPT_BLOCKS blocks."""
    nodes = graph.nodes
    previous, template, end = _periods(nodes, run)
    template_block = run.block(run.start + KEPT_BLOCKS - 1)
    twin = {p.name: t.name for p, t in zip(previous, template)}  # previous block's node -> template's
    in_template = {t.name for t in template}
    inputs = dict(graph.inputs)
    block_inputs = {name: g for name, g in graph.inputs.items()
                    if g.kind in ("parameter", "buffer") and _rename_module(g.target, template_block, "") != g.target}
    taken = set(graph.node_by_name) | set(graph.inputs)
    copies: list[OpNode] = []
    roots = dict(graph.storage_root)
    last: dict[str, str] = {t.name: t.name for t in template}  # template node -> its newest clone

    for position in range(run.start + KEPT_BLOCKS, run.stop):
        block = run.block(position)
        clone_name = {t.name: f"{t.name}__{run.keys[position]}" for t in template}
        input_name = {name: f"{name}__{run.keys[position]}" for name in block_inputs}
        if taken & (set(clone_name.values()) | set(input_name.values())):
            raise RepeatError("cloned names collide with traced ones")
        for name, g in block_inputs.items():
            target = _rename_module(g.target, template_block, block)
            inputs[input_name[name]] = GraphInput(input_name[name], g.kind, target, g.meta, g.requires_grad)

        def rewire(ref: ValueRef) -> ValueRef:
            if ref.node in in_template:
                return ValueRef(clone_name[ref.node], ref.index)
            if ref.node in twin:
                return ValueRef(last[twin[ref.node]], ref.index)
            if ref.node in input_name:
                return ValueRef(input_name[ref.node], ref.index)
            return ref

        for t in template:
            args, kwargs = _map_refs((t.args, t.kwargs), rewire)
            stack = tuple(_rename_module(m, template_block, block) for m in t.module_stack)
            copies.append(OpNode(clone_name[t.name], t.target, args, kwargs, t.outputs, stack, t.grad_enabled))
            for index in range(len(t.outputs)):
                ref = ValueRef(t.name, index)
                roots[rewire(ref)] = rewire(roots.get(ref, ref))
        for name in block_inputs:
            roots[ValueRef(input_name[name])] = ValueRef(input_name[name])
        last = {t.name: clone_name[t.name] for t in template}

    def to_last(ref: ValueRef) -> ValueRef:
        return ValueRef(last[ref.node], ref.index) if ref.node in last else ref

    after = []
    for node in nodes[end:]:
        args, kwargs = _map_refs((node.args, node.kwargs), to_last)
        after.append(OpNode(node.name, node.target, args, kwargs, node.outputs, node.module_stack,
                            node.grad_enabled))
    for node in after:
        for index in range(len(node.outputs)):
            ref = ValueRef(node.name, index)
            roots[ref] = to_last(roots.get(ref, ref))
    return OpGraph(
        inputs=inputs,
        nodes=nodes[:end] + copies + after,
        outputs=tuple(to_last(ref) for ref in graph.outputs),
        storage_root=roots,
        method=graph.method,
        failures=graph.failures,
        parameters=graph.parameters,
        param_dtype=graph.param_dtype,
        tokens_per_sample=graph.tokens_per_sample,
    )


def _map_refs(value: Any, fn: Callable[[ValueRef], ValueRef]) -> Any:
    """`value` with every ValueRef in it replaced by fn(ref): the containers an op's arguments hold (tuples, lists,
    fx's immutable lists, dicts) rebuilt as their own types, as pytree's tree_map does, without its cost per leaf
    (a third of a 128-layer model's expansion)."""
    if isinstance(value, ValueRef):
        return fn(value)
    kind = type(value)
    if kind is tuple:
        return tuple(_map_refs(v, fn) for v in value)
    if kind is list or kind is immutable_list:
        return kind(_map_refs(v, fn) for v in value)
    if kind is dict:
        return {k: _map_refs(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list, dict)):  # another container (a named tuple, an OrderedDict): pytree's way
        return torch.utils._pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, ValueRef) else leaf, value)
    return value
