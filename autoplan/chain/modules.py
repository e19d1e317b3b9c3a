"""Coarsen a profile's ops into an ordered chain of modules (module FQNs) that pipeline stages split.

Starting from the root module's children, the module holding the largest share of the work is
expanded into its child modules until no module exceeds `max_module_share` of the total (or it is a
leaf); containers that run no op themselves and whose children are numbered (ModuleList) are always
expanded. A GPT gives [wte, wpe, blocks.0, ..., blocks.N, ln_f, lm_head].

Contract with codegen: a stage is a contiguous slice of modules; an op belongs to the module whose FQN
appears in its module_stack. Ops in no module ("glue", e.g. root-level adds or a block's residual add
once the block was expanded) are charged, for cost, to the module of the nearest preceding op that has
one (or to the first module).

Every quantity on a ChainModule is PER SAMPLE (divided by ModelProfile.batch_size) in the capture dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoplan.profile_data import ModelProfile, OpProfile

ROOT = ""
"""Name of the root module in the module tree (module_stack excludes it)."""


@dataclass(frozen=True)
class ChainModule:
    """One link of the chain: a module whose ops always run on the same pipeline stage."""

    index: int
    """Position in the chain."""
    fqn: str
    """Fully qualified module name; it appears in the module_stack of every op it owns."""
    ops: tuple[str, ...]
    """Node names of the ops charged to this module (its own ops and attached glue), in graph order."""
    flops_fwd: float
    """Forward FLOPs per sample."""
    flops_bwd: float
    """Backward FLOPs per sample."""
    time_fwd_s: float
    """Forward time per sample on the profiled device, seconds (profile time / batch size)."""
    time_bwd_s: float
    """Backward time per sample on the profiled device, seconds."""
    op_count: int
    """Number of ops (each launches at least one kernel; not per sample)."""
    parameter_numel: int
    """Elements of every parameter the module's ops read, tied ones included."""
    exclusive_parameter_numel: int
    """Elements of the parameters only this module reads (parameter_numel minus its tied groups)."""
    saved_bytes: float
    """Bytes autograd keeps for backward, per sample, capture dtype."""
    memory_traffic_bytes: float
    """Bytes the forward reads and writes (inputs + outputs of its ops), per sample."""
    parameters: tuple[str, ...] = ()
    """FQNs of the parameters charged to this module (tied ones included), sorted."""


@dataclass(frozen=True)
class TiedGroup:
    """A parameter read by several modules (e.g. an embedding tied to the LM head)."""

    parameter: str
    """FQN of the parameter as named in ModelProfile.parameters."""
    numel: int
    """Elements of the parameter."""
    modules: tuple[int, ...]
    """Indices of the modules that read it (two or more), ascending."""


@dataclass(frozen=True)
class ModuleChain:
    """The model as an ordered chain of modules."""

    modules: tuple[ChainModule, ...]
    cut_bytes: tuple[float, ...]
    """cut_bytes[i]: bytes per sample of op outputs from modules <= i read by modules > i (each producer
    once); what a pipeline boundary after module i sends forward. Length len(modules) - 1."""
    tied_groups: tuple[TiedGroup, ...]
    profile_batch_size: int
    """ModelProfile.batch_size the per-sample numbers were divided by."""
    capture_dtype: str
    """ModelProfile.dtype."""
    device: str
    """ModelProfile.device ("cpu" = measured here, else the hardware profile of the roofline)."""
    tokens_per_sample: int | None = None
    whole_reason: str | None = None
    """Why the model is a single module (no pipeline stage can be cut), naming the module; None otherwise."""

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(u.fqn for u in self.modules)

    @property
    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample, no recomputation."""
        return sum(u.flops_fwd + u.flops_bwd for u in self.modules)

    @property
    def parameter_numel(self) -> int:
        """Elements of all parameters, tied ones counted once."""
        return sum(u.exclusive_parameter_numel for u in self.modules) + sum(g.numel for g in self.tied_groups)

    def tied_groups_of(self, index: int) -> tuple[TiedGroup, ...]:
        return tuple(g for g in self.tied_groups if index in g.modules)


def build_chain(profile: ModelProfile, max_module_share: float = 1 / 8) -> ModuleChain:
    """The chain of modules of `profile`; see the module docstring."""
    ops = profile.ops
    if not ops:
        raise ValueError(f"profile of {profile.model} has no ops")
    tree = _module_tree(ops)
    weight = _op_weights(ops)
    from autoplan.chain.tensor_parallel import find_tensor_parallel_plan

    keep_whole = frozenset(find_tensor_parallel_plan(profile, vocab_parallel=False))
    modules = _choose_modules(ops, tree, weight, max_module_share, keep_whole)
    whole_reason = _whole_reason(tree) if modules == [ROOT] else None
    assignment = _assign_ops(ops, modules)
    order = sorted(modules, key=lambda u: assignment.first_op[u])
    index_of = {fqn: i for i, fqn in enumerate(order)}
    op_module = [index_of[u] for u in assignment.module_of_op]
    batch = profile.batch_size
    param_modules = _parameter_modules(profile, op_module, order)
    tied = tuple(
        TiedGroup(name, profile.parameters[name], tuple(sorted(us)))
        for name, us in sorted(param_modules.items()) if len(us) > 1
    )
    built = []
    for i, fqn in enumerate(order):
        mine = [op for op, u in zip(ops, op_module) if u == i]
        params = [name for name, us in param_modules.items() if i in us]
        numel = sum(profile.parameters[p] for p in params)
        tied_numel = sum(g.numel for g in tied if i in g.modules)
        built.append(ChainModule(
            index=i, fqn=fqn, ops=tuple(op.node for op in mine),
            flops_fwd=sum(op.flops_fwd for op in mine) / batch,
            flops_bwd=sum(op.flops_bwd for op in mine) / batch,
            time_fwd_s=sum(op.time_fwd_s for op in mine) / batch,
            time_bwd_s=sum(op.time_bwd_s for op in mine) / batch,
            op_count=len(mine),
            parameter_numel=numel,
            exclusive_parameter_numel=numel - tied_numel,
            saved_bytes=sum(op.saved_bytes for op in mine) / batch,
            memory_traffic_bytes=sum(op.input_bytes + op.output_bytes for op in mine) / batch,
            parameters=tuple(sorted(params)),
        ))
    return ModuleChain(
        modules=tuple(built),
        cut_bytes=tuple(b / batch for b in _cut_bytes(ops, op_module, len(order))),
        tied_groups=tied,
        profile_batch_size=batch,
        capture_dtype=profile.dtype,
        device=profile.device,
        tokens_per_sample=profile.tokens_per_sample,
        whole_reason=whole_reason,
    )


@dataclass
class _Tree:
    """Modules seen in module stacks, parent -> children; per module, `ops`: indices of the ops in its subtree,
    `own`: ops whose innermost module it is, `first`: its first op."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    children: dict[str, dict[str, None]] = field(default_factory=dict)
    """Parent -> its children, in the order first seen (a dict as an ordered set)."""

    def add(self, fqn: str, **attributes: Any) -> None:
        self.nodes[fqn] = attributes
        self.children[fqn] = {}

    def successors(self, fqn: str) -> list[str]:
        return list(self.children[fqn])

    def out_degree(self, fqn: str) -> int:
        return len(self.children[fqn])


def _module_tree(ops: tuple[OpProfile, ...]) -> _Tree:
    """Parent -> child edges between modules seen in module stacks, with each module's ops (_Tree)."""
    tree = _Tree()
    tree.add(ROOT, ops=[], own=[])
    for i, op in enumerate(ops):
        tree.nodes[ROOT]["ops"].append(i)
        parent = ROOT
        for fqn in op.module_stack:
            if fqn not in tree.nodes:
                tree.add(fqn, ops=[], own=[], first=i)
            tree.children[parent][fqn] = None
            tree.nodes[fqn]["ops"].append(i)
            parent = fqn
        tree.nodes[parent]["own"].append(i)
    return tree


def _op_weights(ops: tuple[OpProfile, ...]) -> list[float]:
    """What 'share of the work' means: measured/estimated time if any, else FLOPs, else op count."""
    times = [op.time_fwd_s + op.time_bwd_s for op in ops]
    if sum(times) > 0:
        return times
    flops = [op.flops_fwd + op.flops_bwd for op in ops]
    if sum(flops) > 0:
        return flops
    return [1.0] * len(ops)


def _children(tree: _Tree, fqn: str) -> list[str]:
    return sorted(tree.successors(fqn), key=lambda c: tree.nodes[c]["first"])


def _is_numbered_container(tree: _Tree, fqn: str) -> bool:
    """A ModuleList-like container: runs no op itself and its children are fqn.0, fqn.1, ..."""
    kids = list(tree.successors(fqn))
    prefix = fqn + "."
    return bool(kids) and not tree.nodes[fqn]["own"] and all(
        k.startswith(prefix) and k[len(prefix):].isdigit() for k in kids
    )


def _choose_modules(ops, tree: _Tree, weight: list[float], max_module_share: float,
                  tensor_parallel_linears: frozenset[str] = frozenset()) -> list[str]:
    """Expand the heaviest modules into their children. A module stays whole when its children include
    tensor-parallel Linears, so no pipeline stage boundary cuts a colwise -> rowwise pair apart (the
    sharded activations between them never cross stages), and when a child is called again after a
    sibling ran (a dropout module applied to the attention output and again to the MLP's): stages are
    contiguous runs of modules, and such a child's calls would straddle a boundary."""
    modules = _children(tree, ROOT)
    if not modules or _interleaved(tree, ROOT):
        return [ROOT]  # the root runs every op itself, or its children interleave: a single pipeline stage
    total = sum(weight) or 1.0

    def share(fqn: str) -> float:
        return sum(weight[i] for i in tree.nodes[fqn]["ops"]) / total

    while True:
        expandable = [
            u for u in modules
            if tree.out_degree(u) > 0 and (share(u) > max_module_share or _is_numbered_container(tree, u))
            and not any(child in tensor_parallel_linears for child in _children(tree, u))
            and not _interleaved(tree, u)
        ]
        if not expandable:
            return modules
        containers = [u for u in expandable if _is_numbered_container(tree, u)]
        target = containers[0] if containers else max(expandable, key=lambda u: (share(u), -modules.index(u)))
        at = modules.index(target)
        modules[at:at + 1] = _children(tree, target)


def _interleaved(tree: _Tree, fqn: str) -> bool:
    """Some child of `fqn` runs ops after a later sibling started (a module called twice around it)."""
    return _interleaving(tree, fqn) is not None


def _interleaving(tree: _Tree, fqn: str) -> tuple[str, str] | None:
    """(child, sibling): a child of `fqn` that runs ops again after the sibling started; None if none does."""
    spans = sorted((min(tree.nodes[c]["ops"]), max(tree.nodes[c]["ops"]), c) for c in tree.successors(fqn))
    for (_, end, child), (next_start, _, sibling) in zip(spans, spans[1:]):
        if end > next_start:
            return child, sibling
    return None


def _whole_reason(tree: _Tree) -> str:
    """Why the root could not be cut into child modules (the model runs as one pipeline stage)."""
    pair = _interleaving(tree, ROOT) if _children(tree, ROOT) else None
    if pair is None:
        return "the model's forward runs its ops itself, in no child module"
    child, sibling = pair
    return (f"the model stays one module: its child module {child!r} runs again after {sibling!r} started, so no "
            f"stage boundary can fall between them")


@dataclass
class _Assignment:
    module_of_op: list[str]
    first_op: dict[str, int]


def _assign_ops(ops: tuple[OpProfile, ...], modules: list[str]) -> _Assignment:
    """Each op's module (glue -> the nearest preceding op's module, else the first module in order)."""
    module_set = set(modules)
    own: list[str | None] = []
    first: dict[str, int] = {}
    for i, op in enumerate(ops):
        found = ROOT if modules == [ROOT] else next((m for m in op.module_stack if m in module_set), None)
        own.append(found)
        if found is not None:
            first.setdefault(found, i)
    for fqn in modules:  # a module with no op of its own cannot occur: modules come from module stacks
        assert fqn in first, fqn
    earliest = min(modules, key=lambda u: first[u])
    resolved, previous = [], earliest
    for found in own:
        previous = found if found is not None else previous
        resolved.append(previous)
    return _Assignment(resolved, first)


def _parameter_modules(profile: ModelProfile, op_module: list[int], order: list[str]) -> dict[str, set[int]]:
    """Parameter FQN -> modules whose ops read it; unread parameters go to the module whose FQN is the
    longest dotted prefix of their name (else the first module)."""
    readers: dict[str, set[int]] = {name: set() for name in profile.parameters}
    for op, u in zip(profile.ops, op_module):
        for name in op.params:
            if name in readers:
                readers[name].add(u)
    for name, us in readers.items():
        if not us:
            owners = [i for i, fqn in enumerate(order) if fqn and name.startswith(fqn + ".")]
            us.add(max(owners, key=lambda i: len(order[i])) if owners else 0)
    return readers


def _cut_bytes(ops: tuple[OpProfile, ...], op_module: list[int], n_modules: int) -> list[float]:
    """Bytes crossing each boundary, from the data-flow graph (each producer counted once)."""
    position = {op.node: i for i, op in enumerate(ops)}
    readers: list[list[int]] = [[] for _ in ops]  # the data-flow graph: producer -> the ops reading its output
    for i, op in enumerate(ops):
        for src in op.inputs:
            if src in position:
                readers[position[src]].append(i)
    crossing = [0.0] * n_modules  # difference array over cut indices
    for producer in range(len(ops)):
        consumers = [op_module[c] for c in readers[producer]]
        last = max(consumers, default=op_module[producer])
        first_cut = op_module[producer]
        if last > first_cut:
            crossing[first_cut] += ops[producer].output_bytes
            crossing[last] -= ops[producer].output_bytes
    cuts, running = [], 0.0
    for i in range(n_modules - 1):
        running += crossing[i]
        cuts.append(running)
    return cuts
