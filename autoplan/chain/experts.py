"""Mixture-of-experts layers in the captured graph (torch-free), what expert parallelism shards.

An expert layer is a router and the experts it routes to, as transformers' MoE families (Mixtral,
Qwen2-MoE, OLMoE, ...) and examples/mixtral.py write them:

- the router: a module whose ops pick the top k of E scores per token (`aten.topk` on a (tokens, E) input);
- its experts: a sibling module (same parent) whose parameters are stacked per expert, E weight matrices
  in one (E, a, b) tensor each (`gate_up_proj`, `down_proj`), multiplied by a grouped matmul.

Found from op names, module names and input shapes alone, so it works on any captured graph. A model
whose experts are a list of separate MLP modules is not matched here (each such expert would be its own
module of the chain, shardable only as a whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.chain.ops import is_grouped_matmul_name, packet
from autoplan.profile_data import ModelProfile, OpProfile


@dataclass(frozen=True)
class ExpertLayer:
    """One router and the experts module it routes tokens to."""

    module: str
    """FQN of the experts module (its stacked weights are what expert parallelism shards)."""
    router: str
    """FQN of the router module (its top-k picks each token's experts)."""
    parameters: tuple[str, ...]
    """FQNs of the experts module's stacked parameters, sorted."""
    num_experts: int
    """Experts in the layer (E, dimension 0 of every stacked parameter)."""
    top_k: int
    """Experts each token is sent to (k)."""
    tokens: int
    """Tokens the router scored in the profiled batch (every position of every sample)."""
    hidden: int
    """Features of a token row sent to an expert (what an all-to-all moves per row)."""
    parameter_numel: int
    """Elements of the stacked parameters (all experts)."""


def expert_layers(profile: ModelProfile) -> tuple[ExpertLayer, ...]:
    """Every expert layer of the graph, in graph order."""
    consumers: dict[str, list[OpProfile]] = {}
    near: dict[str, list[OpProfile]] = {}  # by module: the ops of its children and grandchildren
    for op in profile.ops:
        for name in op.inputs:
            consumers.setdefault(name, []).append(op)
        parent = _parent(op.module)
        near.setdefault(parent, []).append(op)
        if _parent(parent) != parent:
            near.setdefault(_parent(parent), []).append(op)
    layers = []
    for op in profile.ops:
        if packet(op) != "topk" or not op.input_shapes or len(op.input_shapes[0]) != 2:
            continue
        tokens, experts = op.input_shapes[0]
        found = _experts_module(near.get(_parent(op.module), []), _parent(op.module), experts)
        if found is None:
            continue
        module, stacked, hidden = found
        layers.append(ExpertLayer(
            module=module, router=op.module, parameters=stacked, num_experts=experts,
            top_k=_top_k(op, tokens, consumers), tokens=tokens, hidden=hidden,
            parameter_numel=sum(profile.parameters.get(name, 0) for name in stacked)))
    return tuple(layers)


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _experts_module(ops: list[OpProfile], parent: str, experts: int) -> tuple[str, tuple[str, ...], int] | None:
    """(module, its stacked parameters, the features of a row it takes) of the child of `parent` whose
    parameters are `experts` stacked matrices, or None; `ops`: those of parent's children and grandchildren."""
    stacked: dict[str, set[str]] = {}
    rows: dict[str, int] = {}
    for op in ops:
        for name, shape in _parameter_shapes(op):
            if len(shape) == 3 and shape[0] == experts:
                stacked.setdefault(_parent(name), set()).add(name)
        if is_grouped_matmul(op) and len(op.input_shapes) >= 2 and len(op.input_shapes[1]) == 3 \
                and op.input_shapes[1][0] == experts and len(op.input_shapes[0]) == 2:
            rows.setdefault(op.module, op.input_shapes[0][1])
    for module, names in stacked.items():
        if _parent(module) == parent:
            return module, tuple(sorted(names)), rows.get(module, 0)
    return None


def _parameter_shapes(op: OpProfile) -> list[tuple[str, tuple[int, ...]]]:
    """(parameter, shape) for an op that reads exactly one parameter and one tensor (a view or cast of
    the weight, as a grouped matmul's operand is prepared)."""
    if len(op.params) == 1 and len(op.input_shapes) == 1:
        return [(op.params[0], op.input_shapes[0])]
    return []


def is_grouped_matmul(op: OpProfile) -> bool:
    """A matmul of row groups by stacked weights (aten._grouped_mm, transformers' grouped_mm fallback)."""
    return is_grouped_matmul_name(packet(op))


def _top_k(router: OpProfile, tokens: int, consumers: dict[str, list[OpProfile]]) -> int:
    """k, from the (tokens, k) shape of what reads the top-k (its weights or indices)."""
    for reader in consumers.get(router.node, []):
        for shape in reader.input_shapes:
            if len(shape) == 2 and shape[0] == tokens and shape[1] != router.input_shapes[0][1]:
                return shape[1]
    return 1
