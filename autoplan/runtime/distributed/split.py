"""Pipeline split: per-stage nn.Modules cut from the exported graph of the real model.

torch.export (non-strict) traces the model on one micro-batch; every op carries the FQNs of the
modules it ran in (meta["nn_module_stack"]). An op belongs to stage k when one of those modules
equals or lies under a chain module of plan.stages[k].modules. Other ops:
  - getitem follows the op whose result it unpacks;
  - ops that read no parameter and no input (arange, masks from constants) are recomputed by every
    stage that uses them, so they are never sent between stages;
  - everything else (root-level glue such as a residual add) runs on the latest stage among its
    inputs, stage 0 if none.
A value made on stage i and used on stage j > i + 1 is threaded through the stages in between:
stage k's outputs are the values still needed by stages > k, in graph order, and they arrive as the
positional arguments of stage k + 1 (how PipelineStage passes them). Stage 0 takes the flattened
model inputs; the last stage returns the flattened model outputs (rebuild them with out_spec).
Every tensor a stage returns is contiguous (isend rejects views such as a transpose); one sent to the next stage
is sent as it lies in memory and arrives with the strides the exported graph gave it (stage_graph.SendLayout), so
the receiving stage's views work as they did in the model. Values that are not tensors are never sent: constants
(a forward that returns (logits, None), use_cache=True in a batch) are carried (PipelineSplit.output_constants,
input_constants), a KV cache in the output is dropped before export (contract.outputs_without_caches).

Parameters keep the model's real tensors. One used on several stages (tied weights) gets a copy per
stage with the same initial value; the training program sums their gradients (see TiedParameter).

With experts_as_modules (expert parallelism), each experts module is exported as one opaque call
(runtime/distributed/expert_calls.py) that the stage turns back into a call of the model's module
(runtime/distributed/stage_graph.py).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from autoplan.capture.experts import is_experts_module
from autoplan.contract import (CONSTANT_TYPES, LossFn, compute_loss, disable_kv_cache, model_args,
                               outputs_without_caches)
from autoplan.errors import UserError
from autoplan.runtime.distributed.expert_calls import called_experts, experts_as_calls, modules_as_calls
from autoplan.runtime.distributed.stage_graph import SendLayout, StagePlan, StateTensor, build_stage_module


@dataclass(frozen=True)
class TiedParameter:
    """A parameter used on several pipeline stages (e.g. lm_head.weight tied to wte.weight)."""

    fqn: str
    """The model's name for it (the first name export gave it)."""
    stages: tuple[int, ...]
    """The stages that hold a copy, ascending."""
    names: tuple[str, ...]
    """Its attribute path inside each of those stage modules (same order as `stages`)."""


@dataclass
class PipelineSplit:
    stages: list[fx.GraphModule | None]
    """One module per stage (None once dropped); stage k's forward takes stage k - 1's outputs as positional args."""
    chain_modules: list[tuple[str, ...]]
    """Per stage: the chain modules that are submodules the stage calls (wrap these with FSDP or
    checkpointing). A chain module whose ops interleave with other code stays inlined and is not listed."""
    tied: tuple[TiedParameter, ...]
    """Parameters whose copies on several stages must receive the summed gradient."""
    boundary_meta: list[tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]]
    """(shape, dtype, requires_grad) of the tensors entering stage k (k = 0: the flat model inputs)
    and, at index num_stages, of the model outputs, for one micro-batch (static PipelineStage
    metadata: the stages then skip their shape-inference pass)."""
    parameter_fqns: list[dict[str, str]]
    """Per stage: parameter name inside the stage module -> the model's FQN."""
    state_fqns: list[dict[str, str]]
    """Per stage: parameter or buffer name inside the stage module -> the model's FQN (constants
    the export lifted out of forward are not the model's and are not listed)."""
    in_spec: pytree.TreeSpec
    """Pytree spec of (args, kwargs) the model was exported with."""
    out_spec: pytree.TreeSpec
    """Pytree spec of the model output; the last stage returns its tensor leaves."""
    output_constants: tuple[tuple[int, Any], ...] = ()
    """(position among the output's leaves, value) of the leaves that are not tensors (the None of a forward that
    returns (logits, None)): the pipeline does not send them, unflatten_output puts them back."""
    input_constants: tuple[int, ...] = ()
    """Positions among the flat model inputs of those that are not tensors (use_cache=True in a batch): the export
    took them as constants, stage 0 takes only the tensors."""

    def example_tensors(self, stage: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Empty tensors shaped like one micro-batch's inputs and outputs of `stage`."""
        def make(metas):
            return tuple(torch.empty(shape, dtype=dtype, device=device, requires_grad=grad) for shape, dtype, grad in metas)
        return make(self.boundary_meta[stage]), make(self.boundary_meta[stage + 1])

    def drop_other_stages(self, keep: Sequence[int]) -> None:
        """Forget every stage module but those in `keep`, so the parameters other ranks run can be freed."""
        self.stages = [stage if k in keep else None for k, stage in enumerate(self.stages)]

    def flatten_inputs(self, inputs: Any) -> list[Any]:
        """The positional arguments of stage 0 for a batch of model inputs."""
        leaves, spec = pytree.tree_flatten(model_args(inputs))
        if spec != self.in_spec:
            raise UserError(f"model inputs changed structure since the pipeline split: {spec} vs {self.in_spec}")
        return [leaf for i, leaf in enumerate(leaves) if i not in self.input_constants]

    def unflatten_output(self, flat: Sequence[Any]) -> Any:
        """The model output from the last stage's tensors (and the constants the output had)."""
        sent, constants = iter(flat), dict(self.output_constants)
        leaves = [constants[i] if i in constants else next(sent) for i in range(len(flat) + len(constants))]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def loss(self, loss_fn: LossFn | None) -> LossFn:
        """Loss on the last stage's output: the model output rebuilt, then loss_fn or the default."""
        def pipeline_loss(output: Any, targets: Any) -> torch.Tensor:
            flat = output if isinstance(output, (tuple, list)) else (output,)
            return compute_loss(loss_fn, self.unflatten_output(flat), targets)
        return pipeline_loss


def split_model(model: nn.Module, inputs: Any, stage_chain_modules: Sequence[Sequence[str]],
                device: torch.device | None = None, experts_as_modules: bool = False,
                module_calls: Sequence[str] = ()) -> PipelineSplit:
    """Export `model` on `inputs` (one micro-batch) and cut it into len(stage_units) stages.

    experts_as_modules: the stages call the model's experts modules (runtime/distributed/expert_calls.py) instead of
    running their ops inlined, so expert parallelism can shard them.
    module_calls: modules the stages call as the model's own modules instead of running their ops inlined
    (runtime/distributed/expert_calls.py modules_as_calls), so the runtime can wrap them (a mixture of experts' block run on
    each tensor-parallel rank's tokens).

    A model on the meta device with a `device` to run on is exported on fake tensors of that device (no
    memory), so code that branches on the device type takes the branch the stages will run (transformers'
    MoE counts tokens per expert with a float histogram on CPU: traced on meta it recorded the integer
    one, which CPU lacks). Without a `device`, a meta model is exported on meta."""
    args, kwargs = model_args(inputs)
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if experts_as_modules and not any(map(is_experts_module, model.modules())):
        raise UserError(f"expert parallelism, but {type(model).__name__} has no experts module (num_experts and "
                        f"weights stacked per expert on dimension 0) to split: plan it with ep=1")
    kwargs = disable_kv_cache(model, kwargs)  # training keeps no KV cache (Hugging Face models return one by default)
    try:
        with experts_as_calls(model) if experts_as_modules else contextlib.nullcontext(), \
                modules_as_calls(model, tuple(module_calls)), outputs_without_caches(model):
            exported = _export(model, args, kwargs, on_meta, device)
    except Exception as e:  # noqa: BLE001 - any tracing failure in user code is reported as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"torch.export could not trace the model for the pipeline split: {type(e).__name__}: {first}") from None
    return split_exported(exported, model, stage_chain_modules)


def _export(model: nn.Module, args: tuple, kwargs: dict, on_meta: bool,
            device: torch.device | None) -> torch.export.ExportedProgram:
    if on_meta and device is not None:
        return _export_on_fake_device(model, args, kwargs, torch.device(device))
    # on meta, tensors the forward creates without a device (torch.ones(n)) must be meta too
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        return torch.export.export(model, args, kwargs, strict=False)


def _export_on_fake_device(model: nn.Module, args: tuple, kwargs: dict, device: torch.device):
    """torch.export of a meta `model` with its parameters, buffers and inputs swapped for fake tensors on
    `device` (fake_on_device)."""
    with fake_on_device(model, device) as fakes, torch.device(device):
        return torch.export.export(model, fakes.inputs(args), fakes.inputs(kwargs), strict=False)


@dataclass(frozen=True)
class FakeModel:
    """What fake_on_device yields."""

    mode: Any
    """The FakeTensorMode the model's fakes belong to (enter it to run the model)."""
    fake: Any
    """tensor -> a fake tensor of its shape, stride and dtype on the device (the same one for the same tensor)."""

    def inputs(self, tree: Any) -> Any:
        """`tree` with every tensor made such a fake."""
        return pytree.tree_map(lambda value: self.fake(value) if isinstance(value, torch.Tensor) else value, tree)


@contextlib.contextmanager
def fake_on_device(model: nn.Module, device: torch.device):
    """Within: `model`'s (meta) parameters and buffers are fake tensors on `device` (the same fake for every name of
    a shared tensor), so code that branches on the device type takes the branch the real run will; yields the
    FakeModel (its mode, and how inputs become such fakes). The meta tensors are put back after."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            with mode:
                made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            fakes[id(tensor)] = nn.Parameter(made, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else made
        return fakes[id(tensor)]

    originals = []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    originals.append((store, name, tensor))
                    store[name] = fake(tensor)
    try:
        yield FakeModel(mode, fake)
    finally:
        for store, name, tensor in originals:
            store[name] = tensor


def split_exported(exported: torch.export.ExportedProgram, model: nn.Module,
                   stage_chain_modules: Sequence[Sequence[str]]) -> PipelineSplit:
    num_stages = len(stage_chain_modules)
    if num_stages < 1:
        raise UserError("the pipeline split needs at least one stage")
    state, user_inputs = _state_placeholders(exported, model)
    model_state = {fqn for fqn, _ in [*model.named_parameters(remove_duplicate=False),
                                      *model.named_buffers(remove_duplicate=False)]}
    chain_module_stage = _chain_module_stage_map(stage_chain_modules)
    graph = exported.graph_module.graph
    experts = {fqn: model.get_submodule(fqn) for fqn in map(called_experts, graph.nodes) if fqn is not None}
    assignment = _assign(graph, state, chain_module_stage)
    _check_chain_modules_used(assignment, chain_module_stage)

    order = {node: i for i, node in enumerate(graph.nodes)}
    output_node = next(n for n in graph.nodes if n.op == "output")
    model_outputs = list(output_node.args[0])
    last_use = _last_use(assignment.stage, output_node, num_stages)
    crossing = [[v for v in sorted(assignment.stage, key=order.__getitem__)
                 if assignment.stage[v] < k <= last_use.get(v, -1)]
                for k in range(1, num_stages)]
    constants = _constants(assignment, [*user_inputs, *(v for values in crossing for v in values), *model_outputs])
    boundary = [[v for v in values if v not in constants] for values in [user_inputs, *crossing]]
    input_constants = tuple(i for i, v in enumerate(user_inputs) if v in constants)
    sent_outputs = [o for o in model_outputs if isinstance(o, fx.Node) and o not in constants]
    output_constants = tuple((i, constants.get(o, o)) for i, o in enumerate(model_outputs) if o not in sent_outputs)
    layouts = {v: SendLayout.of(v.meta["val"]) for values in boundary[1:] for v in values}
    first_holder: dict[int, int] = {}
    stages, chain_modules, fqns, state_fqns, holders = [], [], [], [], {}
    for k in range(num_stages):
        outputs = boundary[k + 1] if k + 1 < num_stages else sent_outputs
        own = [n for n in graph.nodes if assignment.stage.get(n) == k and n.op != "placeholder"]
        nodes = _with_free_inputs(own, outputs, assignment.free, order)
        plan = StagePlan(index=k, inputs=list(boundary[k]), nodes=nodes, outputs=outputs,
                         chain_module_of={n: assignment.chain_module.get(n) for n in nodes},
                         state=_stage_state(nodes, state, k, first_holder), attributes=exported.graph_module,
                         experts=experts, layouts=layouts, constants=constants)
        module, names, called_chain_modules = build_stage_module(plan)
        stages.append(module)
        chain_modules.append(called_chain_modules)
        params = {name: t for name, t in names.items() if t.is_parameter}
        fqns.append({name: t.fqn for name, t in params.items()})
        state_fqns.append({name: t.fqn for name, t in names.items() if t.is_parameter or t.fqn in model_state})
        for name, t in params.items():
            holders.setdefault(t.key, []).append((k, name, t.fqn))
    tied = tuple(
        TiedParameter(fqn=held[0][2], stages=tuple(h[0] for h in held), names=tuple(h[1] for h in held))
        for held in holders.values() if len(held) > 1
    )
    carries_grad = _carries_grad(graph, state)
    metas = [tuple(_meta_of(v, carries_grad, layouts.get(v)) for v in values)
             for values in [*boundary, sent_outputs]]
    return PipelineSplit(stages, chain_modules, tied, metas, fqns, state_fqns, exported.call_spec.in_spec,
                         exported.call_spec.out_spec, output_constants, input_constants)


def _constants(assignment: _Assignment, values: Sequence[Any]) -> dict[fx.Node, Any]:
    """The values among `values` (ops of the graph, or literals export put in its output) that are not tensors,
    each with the constant it stands for (a literal stands for itself). Such a value is used where it is needed and
    never sent: the pipeline sends tensors only. A non-tensor value that is not a constant (a number read from a
    tensor's data) cannot cross a cut: a clear error, naming it and the module that made it."""
    constants: dict[fx.Node, Any] = {}
    for value in values:
        if not isinstance(value, fx.Node):
            if not isinstance(value, CONSTANT_TYPES):
                raise UserError(f"the model's output holds a {type(value).__name__}; a pipeline's last stage returns "
                                f"tensors and constants only: plan this model with --pin pp=1")
            continue
        meta = value.meta.get("val")
        if isinstance(meta, torch.Tensor):
            continue
        if not isinstance(meta, CONSTANT_TYPES):
            module = assignment.chain_module.get(value) or "glue between modules"
            raise UserError(f"{value.name} ({module}, stage {assignment.stage.get(value, 0)}) is a {type(meta).__name__} "
                            f"computed from tensor data and used on a later stage or by the loss; a pipeline sends only "
                            f"tensors and carries only constants: plan this model with --pin pp=1")
        constants[value] = meta
    return constants


def _carries_grad(graph: fx.Graph, state: dict[str, StateTensor]) -> set[fx.Node]:
    """Floating-point values computed from a parameter (export's meta does not record requires_grad)."""
    result = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in state and state[node.name].is_parameter and state[node.name].value.requires_grad:
                result.add(node)
        elif node.op == "call_function" and node.target is not torch.ops.aten.detach.default:
            val = node.meta.get("val")
            floating = isinstance(val, torch.Tensor) and val.is_floating_point()
            if (floating or not isinstance(val, torch.Tensor)) and any(i in result for i in node.all_input_nodes):
                result.add(node)
    return result


def _meta_of(value: Any, carries_grad: set[fx.Node],
             layout: SendLayout | None) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """(shape as sent, dtype, requires_grad) of a tensor entering or leaving a stage."""
    meta = value.meta.get("val") if isinstance(value, fx.Node) else value
    if not isinstance(meta, torch.Tensor):
        raise UserError(f"the pipeline passes only tensors between stages and to the loss; got {type(meta).__name__} "
                        f"({getattr(value, 'name', value)})")
    shape = layout.wire_shape if layout is not None else tuple(int(d) for d in meta.shape)
    return shape, meta.dtype, value in carries_grad


def _state_placeholders(exported, model: nn.Module) -> tuple[dict[str, StateTensor], list[fx.Node]]:
    """Placeholders that stand for parameters, buffers and constants, and those for user inputs."""
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    aliases: dict[int, list[str]] = {}
    for fqn, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(tensor), []).append(fqn)
    state, user_inputs = {}, []
    for spec in exported.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(placeholders[name])
        elif spec.kind == InputKind.PARAMETER:
            param = model.get_parameter(spec.target)
            state[name] = StateTensor(tuple(aliases[id(param)]), param, is_parameter=True, key=id(param))
        elif spec.kind == InputKind.BUFFER:
            buffer = model.get_buffer(spec.target)
            state[name] = StateTensor(tuple(aliases[id(buffer)]), buffer, is_parameter=False, key=id(buffer))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constant = exported.constants[spec.target]
            state[name] = StateTensor((spec.target,), constant, is_parameter=False, key=id(constant))
        else:
            raise UserError(f"the pipeline split does not support model inputs of kind {spec.kind.name} ({name})")
    for spec in exported.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise UserError(f"the model's forward updates {spec.target or spec.arg} ({spec.kind.name}); the pipeline "
                            "split supports models whose forward only reads buffers (e.g. no BatchNorm running stats)")
    return state, user_inputs


def _chain_module_stage_map(stage_chain_modules: Sequence[Sequence[str]]) -> dict[str, int]:
    chain_module_stage: dict[str, int] = {}
    for k, chain_modules in enumerate(stage_chain_modules):
        for chain_module in chain_modules:
            if chain_module in chain_module_stage:
                raise UserError(f"module {chain_module!r} is listed on stages {chain_module_stage[chain_module]} "
                                f"and {k}")
            chain_module_stage[chain_module] = k
    for chain_module in chain_module_stage:
        parent = chain_module.rpartition(".")[0]
        while parent:
            if parent in chain_module_stage:
                raise UserError(f"stage chain modules must not nest: {chain_module!r} lies inside {parent!r}")
            parent = parent.rpartition(".")[0]
    return chain_module_stage


@dataclass
class _Assignment:
    stage: dict[fx.Node, int]
    """Stage of every value (user inputs and ops that are not free)."""
    chain_module: dict[fx.Node, str | None]
    """The chain module an op runs in, None for glue between chain modules."""
    free: set[fx.Node]
    """Ops that read no parameter and no input: recomputed wherever used."""


def _matched_chain_module(node: fx.Node, chain_module_stage: dict[str, int]) -> str | None:
    """The innermost chain module among the node's module FQNs and their parents."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for path in reversed(paths):
        while path:
            if path in chain_module_stage:
                return path
            path = path.rpartition(".")[0]
    return None


def _is_seeded_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _assign(graph: fx.Graph, state: dict[str, StateTensor], chain_module_stage: dict[str, int]) -> _Assignment:
    result = _Assignment({}, {}, set())
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in state:
                result.stage[node], result.chain_module[node] = 0, None
            continue
        if node.op in ("get_attr", "output"):
            continue  # get_attr: subgraphs of higher-order ops, copied wherever used
        if node.op != "call_function":
            raise UserError(f"unexpected node {node.name} ({node.op}) in the exported graph")
        inputs = node.all_input_nodes
        values = [i for i in inputs if i in result.stage]
        if node.target is operator.getitem and inputs and inputs[0] in result.free:
            result.free.add(node)
            continue
        if node.target is operator.getitem and inputs and inputs[0] in result.stage:
            stage, chain_module = result.stage[inputs[0]], result.chain_module[inputs[0]]
        else:
            chain_module = _matched_chain_module(node, chain_module_stage)
            reads_only_constants = all(
                i in result.free or i.op == "get_attr" or (i.name in state and not state[i.name].is_parameter)
                for i in inputs
            )
            if chain_module is None and reads_only_constants and not _is_seeded_random(node):
                result.free.add(node)
                continue
            latest = max((result.stage[i] for i in values), default=0)
            stage = chain_module_stage[chain_module] if chain_module is not None else latest
        for value in values:
            if result.stage[value] > stage:
                raise UserError(
                    f"op {node.name} ({chain_module or 'glue'}) would run on stage {stage} but uses {value.name} from "
                    f"stage {result.stage[value]}: the plan's stages are not in the order the model runs them")
        result.stage[node], result.chain_module[node] = stage, chain_module
    return result


def _check_chain_modules_used(assignment: _Assignment, chain_module_stage: dict[str, int]) -> None:
    used = {u for u in assignment.chain_module.values() if u is not None}
    missing = [u for u in chain_module_stage if u not in used]
    if missing:
        raise UserError(f"stage module(s) {', '.join(map(repr, missing))} run no op in the model's forward: "
                        "the plan does not match this model")


def _last_use(stage: dict[fx.Node, int], output_node: fx.Node, num_stages: int) -> dict[fx.Node, int]:
    """The last stage that uses each value (the model outputs are used by the last stage)."""
    last = {}
    for value in stage:
        uses = [num_stages - 1 if user is output_node else stage[user]
                for user in value.users if user in stage or user is output_node]
        if uses:
            last[value] = max(uses)
    return last


def _with_free_inputs(own: list[fx.Node], outputs: list[Any], free: set[fx.Node], order: dict) -> list[fx.Node]:
    """A stage's own ops plus the free ops they (or its outputs) need, in graph order."""
    free_outputs = [o for o in outputs if isinstance(o, fx.Node) and o in free]
    needed, stack = set(own) | set(free_outputs), [*own, *free_outputs]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp in free and inp not in needed:
                needed.add(inp)
                stack.append(inp)
    return sorted(needed, key=order.__getitem__)


def _stage_state(nodes: list[fx.Node], state: dict[str, StateTensor], stage: int,
                 first_holder: dict[int, int]) -> dict[fx.Node, StateTensor]:
    """The state placeholders a stage's ops read, each mapped to the tensor this stage holds."""
    copies: dict[int, StateTensor] = {}
    result = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp.name in state:
                tensor = state[inp.name]
                if tensor.key not in copies:
                    copies[tensor.key] = _stage_copy(tensor, stage, first_holder)
                result[inp] = copies[tensor.key]
    return result


def _stage_copy(tensor: StateTensor, stage: int, first_holder: dict[int, int]) -> StateTensor:
    """The first stage to use a parameter keeps the model's tensor; later stages get a copy."""
    holder = first_holder.setdefault(tensor.key, stage)
    if holder == stage or not tensor.is_parameter:
        return tensor
    copy = nn.Parameter(tensor.value.detach().clone(), requires_grad=tensor.value.requires_grad)
    return StateTensor(tensor.fqns, copy, is_parameter=True, key=tensor.key)
