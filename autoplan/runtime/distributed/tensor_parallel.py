"""Tensor parallelism (Megatron-style) with torch.distributed.tensor.parallel.parallelize_module.

The plan maps nn.Linear FQNs to "colwise" or "rowwise" (pairs such as qkv -> proj, fc -> proj).
The model is the user's unmodified code, whose reshapes may hard-code the head count
(view(b, t, n_head, c // n_head)). So a column-parallel Linear returns a DTensor
(use_local_output=False): the ops up to the row-parallel Linear see global shapes and DTensor keeps
each rank's shard (heads split along the sharded dim), and the row-parallel Linear all-reduces back
to a plain replicated tensor. Plain tensors that meet a DTensor on the way (rotary cos/sin, masks)
count as replicated (implicit_replication, around forward and backward: tensor_parallel_context).

Sequence parallelism (`sp`, Korthikanti et al. 2022): the ops between the pairs (norms,
dropout, residual adds) run on sequence shards. A row-parallel Linear reduce-scatters its partial
outputs onto the sequence dimension (RowwiseParallel(output_layouts=Shard(1))) instead of all-reducing
them, and a column-parallel Linear all-gathers its sequence-sharded input (ColwiseParallel(input_layouts=
Shard(1)); runtime/distributed/sequence_gather.py gathers once per shared input and keeps the shard for backward, as
Megatron-LM does). Between them the residual stream is a DTensor sharded on dim 1 (batch-first [b, s, h], as
unmodified PyTorch and Hugging Face models are): DTensor runs the norms and adds on each rank's shard.
The parameters the plan does not shard (norm weights, biases, position tables) become replicated
DTensors on the tensor-parallel mesh, as SequenceParallel does for a norm, so their gradients, computed
from a sequence shard, are summed over the ranks (reduce_partial_gradients, after backward). A module's plain floating-point inputs (a pipeline
stage's activations) enter as replicated DTensors, and a plain tensor reaching a column-parallel Linear
counts as replicated. The module's
outputs leave as plain tensors, all-gathered (outputs_to_plain: the loss and a pipeline send see the
full tensors). A rowwise output without a sequence dimension (2-D) is all-reduced as before.

Pipeline stages are exported graphs, where a Linear is an aten.linear call: restore_linears turns
the planned ones back into nn.Linear submodules at the same FQN so parallelize_module applies.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autoplan.errors import UserError
from autoplan.runtime.distributed.sequence_gather import SequenceGather

STYLES = ("colwise", "rowwise", "replicate", "sequence_local")


def tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str],
                    chain_modules: Sequence[str] = (), sp: bool = False) -> nn.Module:
    """Shard the planned Linears of `module` over the tensor-parallel mesh (in place). For a
    pipeline stage (an exported graph running `chain_modules`), the planned Linears inside its chain modules.
    With `sp` (sequence parallelism), the ops between the pairs run on sequence shards (see the module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not plan or tp_mesh.size() == 1:
        return module
    _register_cpu_attention_sharding()
    if not sp:  # "sequence_local": a module run on each rank's sequence shard, nothing without sp
        plan = {fqn: style for fqn, style in plan.items() if style != "sequence_local"}
    if isinstance(module, fx.GraphModule):
        plan = _stage_plan(module, plan, chain_modules)
    styles = {}
    gather = SequenceGather()
    replicated = [fqn for fqn, style in plan.items() if style == "replicate"]
    local = [fqn for fqn, style in plan.items() if style == "sequence_local"]
    for fqn, style in plan.items():
        if style not in STYLES:
            raise UserError(f"tensor-parallel style of {fqn!r} must be one of {STYLES}, got {style!r}")
        if style in ("replicate", "sequence_local"):
            continue
        try:
            layer = module.get_submodule(fqn)
        except AttributeError:
            raise UserError(f"the tensor-parallel plan names {fqn!r}, which the model does not have") from None
        if isinstance(layer, nn.Embedding) and style == "rowwise":  # vocabulary rows split, looked up locally
            if layer.num_embeddings % tp_mesh.size():
                raise UserError(f"{fqn!r} has {layer.num_embeddings} rows, not divisible by tp {tp_mesh.size()}")
            styles[fqn] = RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(1) if sp else Replicate(),
                                          use_local_output=not sp)
            continue
        conv1d = is_conv1d(layer)
        if not isinstance(layer, nn.Linear) and not conv1d:
            kind = "nn.Linear, a transformers Conv1D or (rowwise) nn.Embedding"
            raise UserError(f"the tensor-parallel plan names {fqn!r}, a {type(layer).__name__}, not an {kind}")
        fan_in, fan_out = (layer.weight.shape if conv1d else (layer.in_features, layer.out_features))
        parts = fan_out if style == "colwise" else fan_in
        if parts % tp_mesh.size():
            dim = "output" if style == "colwise" else "input"
            raise UserError(f"{fqn!r} has {parts} {dim} features, not divisible by tp {tp_mesh.size()}")
        colwise = Conv1DColwiseParallel if conv1d else ColwiseParallel
        if style == "colwise" and sp:
            layer.register_forward_pre_hook(_plain_input_replicated(tp_mesh))  # runs before ColwiseParallel's
            gather.attach(layer)  # then this: one all-gather per shared input, its shard kept for backward
            styles[fqn] = colwise(input_layouts=Shard(1), use_local_output=False)
        elif style == "colwise":  # a pair's first half, or the head: its logits stay sharded on the vocabulary
            styles[fqn] = colwise(use_local_output=False)
        else:
            if sp:
                gather.attach_release(layer)  # the region's gathered input is not read after this
            styles[fqn] = (Conv1DRowwiseParallel if conv1d else SequenceRowwiseParallel)(
                input_layouts=Shard(-1), output_layouts=Shard(1) if sp else Replicate(),
                use_local_output=not sp)
    ties = _tied_parameters(module)
    parallelize_module(module, tp_mesh, styles)
    _retie(module, ties)
    if not sp:  # with it every parameter is replicated below
        replicate_parameters(module, tp_mesh, replicated)
    if isinstance(module, fx.GraphModule):  # DTensors run through a stage's graph (split heads, sequence shards)
        _drop_metadata_asserts(module)
    if sp:
        gather.attach_release(module)
        replicate_parameters(module, tp_mesh)
        for fqn in local:
            run_on_local_tokens(_submodule(module, fqn, "sequence_local"), tp_mesh)
        module.register_forward_pre_hook(_float_inputs_replicated(tp_mesh), with_kwargs=True)
    module.register_forward_hook(outputs_to_plain)
    return module


def _submodule(module: nn.Module, fqn: str, style: str) -> nn.Module:
    try:
        return module.get_submodule(fqn)
    except AttributeError:
        raise UserError(f"the tensor-parallel plan names {fqn!r} ({style}), which the model does not have (a "
                        "pipeline stage's graph inlines it)") from None


def run_on_local_tokens(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism through a module that computes token by token but not op by op on DTensors (a mixture
    of experts: its router flattens (batch, sequence) into tokens, gathers them per expert and scatters them back;
    chain/tensor_parallel.py's "sequence_local"): it runs on this rank's sequence shard as plain tensors. Its
    [b, s, ...] DTensor inputs sharded on the sequence enter as their local shards and its outputs leave as such
    DTensors again; its tensor-parallel parameters (replicated DTensors) enter as their local tensors whose gradient
    is Partial (this rank's tokens' share), which reduce_partial_gradients sums over the ranks after backward, as
    for a norm's weight. Parameters on another mesh (experts sharded over expert parallelism) are left as they are:
    their experts module routes this rank's tokens as they are (runtime/distributed/expert_parallel.py TensorParallelTokens,
    told so here), and ExpertParallel sums their gradients over the ranks holding the same experts."""
    from torch.distributed.tensor import DTensor, Partial

    inner = module.forward
    for sub in module.modules():
        tokens = getattr(sub, "tensor_parallel_tokens", None)
        if tokens is not None:
            tokens.local_tokens = True
    islands = _split_islands(module, tp_mesh)

    def local(t):
        if isinstance(t, DTensor) and t.device_mesh == tp_mesh and tuple(t.placements) == (Shard(1),):
            return t.to_local(grad_placements=[Shard(1)])
        if isinstance(t, DTensor):
            raise UserError(f"sequence parallel: {type(module).__name__} takes a {tuple(t.placements)} DTensor, "
                            "expected one sharded on the sequence (dimension 1)")
        return t

    def forward(*args, **kwargs):
        from torch.utils import _pytree as pytree

        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
        if not inputs:  # inside a module that runs on local tokens already
            return inner(*args, **kwargs)
        args, kwargs = pytree.tree_map(local, (args, kwargs))
        saved = {}
        island_params = {id(p) for island in islands for p in island.parameters()}  # FSDP2 swaps them per call
        for owner in module.modules():
            for name, param in owner._parameters.items():
                if isinstance(param, DTensor) and param.device_mesh == tp_mesh and id(param) not in island_params:
                    saved[(owner, name)] = param
        try:
            for (owner, name), param in saved.items():
                owner._parameters[name] = param.to_local(grad_placements=[Partial()])
            output = inner(*args, **kwargs)
        finally:
            for (owner, name), param in saved.items():
                owner._parameters[name] = param
        return pytree.tree_map(lambda t: DTensor.from_local(t, tp_mesh, [Shard(1)], run_check=False)
                               if isinstance(t, torch.Tensor) and t.dim() >= 2 else t, output)

    module.forward = forward


def _split_islands(module: nn.Module, tp_mesh: DeviceMesh) -> list[nn.Module]:
    """The submodules of a module run on local tokens that hold tensor-parallel Linears (chain/tensor_parallel.py
    _split_islands: a shared expert's colwise/rowwise pair, each Linear's parent): they run on DTensors again, their
    plain [b, s/tp, ...] inputs entering as sequence shards (the colwise Linears all-gather them) and their
    outputs (the rowwise Linear's reduce-scatter onto the sequence) leaving as this rank's shard."""
    from torch.distributed.tensor import DTensor

    def split(linear: nn.Module) -> bool:
        weight = getattr(linear, "weight", None)
        return isinstance(weight, DTensor) and weight.device_mesh == tp_mesh and \
            any(not isinstance(p, Replicate) for p in weight.placements)

    islands = []
    for name, sub in module.named_modules():
        if name and any(split(child) for child in sub.children()) and \
                not any(island is sub or _contains(island, sub) for island in islands):
            islands.append(sub)
    for island in islands:
        converted: list[bool] = []  # per call: whether its inputs were local (so its outputs go back local)
        island.register_forward_pre_hook(_local_inputs_sharded(tp_mesh, converted), with_kwargs=True)
        island.register_forward_hook(_sharded_outputs_local(tp_mesh, converted))
    return islands


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _local_inputs_sharded(tp_mesh: DeviceMesh, converted: list[bool]):
    """A forward pre-hook: plain floating-point [b, s/tp, ...] inputs become DTensors sharded on the sequence."""
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    def sharded(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point() and t.dim() >= 3:
            return DTensor.from_local(t, tp_mesh, [Shard(1)], run_check=False)
        return t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        leaves = pytree.tree_leaves((args, kwargs))
        converted.append(not any(isinstance(t, DTensor) for t in leaves))
        if not converted[-1]:
            return None  # called on DTensors (not inside a module run on local tokens)
        return pytree.tree_map(sharded, (args, kwargs))

    return hook


def _sharded_outputs_local(tp_mesh: DeviceMesh, converted: list[bool]):
    """A forward hook: DTensor outputs sharded on the sequence leave as this rank's shard (plain)."""
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    def local(t):
        if isinstance(t, DTensor) and t.device_mesh == tp_mesh and tuple(t.placements) == (Shard(1),):
            return t.to_local(grad_placements=[Shard(1)])
        return t

    def hook(module: nn.Module, args: tuple, output):
        if not converted.pop():
            return None  # its inputs were DTensors already: the caller runs on DTensors
        return pytree.tree_map(local, output)

    return hook


def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (owner, name) slots of every parameter held in two or more places (a head tied to the embedding)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((owner, name))
    return [group for group in slots.values() if len(group) > 1]


def _retie(module: nn.Module, ties: list[list[tuple[nn.Module, str]]]) -> None:
    """parallelize_module gives each module its own new parameter: put one back in every slot of a tie. A
    weight sharded by one user (the vocabulary-parallel embedding) and plain in another (a replicated head)
    keeps the shard: DTensor computes the plain user's op on it correctly. Two users that shard it differently
    cannot share it."""
    from torch.distributed.tensor import DTensor

    for group in ties:
        params = [owner._parameters[name] for owner, name in group]
        sharded = [p for p in params if isinstance(p, DTensor)]
        keep = sharded[0] if sharded else params[0]
        if any(p.placements != keep.placements for p in sharded):
            names = ", ".join(f"{type(owner).__name__}.{name}" for owner, name in group)
            raise UserError(f"tensor parallel: tied parameters ({names}) are sharded differently: "
                            f"{sorted({str(p.placements) for p in sharded})}")
        for owner, name in group:
            owner.register_parameter(name, keep)


def _float_inputs_replicated(tp_mesh: DeviceMesh):
    """A forward pre-hook: the module's plain floating-point inputs (a pipeline stage's activations) become
    replicated DTensors, whose gradients come back whole (DTensor.from_local is differentiable)."""
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    def replicated(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.is_floating_point():
            return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        return t

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return pytree.tree_map(replicated, (args, kwargs))

    return hook


def _drop_metadata_asserts(stage: fx.GraphModule) -> None:
    """Remove the export's aten._assert_tensor_metadata checks (no DTensor sharding rule; they check only)."""
    for graph_module in stage.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        asserts = [n for n in graph_module.graph.nodes if n.op == "call_function"
                   and n.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in asserts:
            graph_module.graph.erase_node(node)
        if asserts:
            graph_module.recompile()


class SequenceRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output_layouts Shard(1) (sequence parallel) applies to outputs with a
    sequence dimension ([b, s, h]); a 2-D output has none and is all-reduced (Replicate)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if tuple(output_layouts) == (Shard(1),) and outputs.ndim < 3:
            output_layouts = (Replicate(),)
        return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a Linear whose weight is stored transposed, [in, out], run as addmm."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _conv1d_partition(placements: dict[str, Placement], src_data_rank):
    def partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor import distribute_tensor

        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placements[param_name]], src_data_rank=src_data_rank),
                requires_grad=param.requires_grad))

    return partition


class Conv1DColwiseParallel(ColwiseParallel):
    """ColwiseParallel for transformers' Conv1D: its [in, out] weight splits on dim 1, its bias on dim 0."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module, device_mesh, _conv1d_partition({"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwiseParallel(SequenceRowwiseParallel):
    """RowwiseParallel for transformers' Conv1D: its [in, out] weight splits on dim 0, its bias stays whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, _conv1d_partition({"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _plain_input_replicated(tp_mesh: DeviceMesh):
    """A forward pre-hook: a plain tensor input is the full (replicated) tensor, not a sequence shard."""
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, args: tuple) -> tuple | None:
        if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
            return (DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False), *args[1:])
        return None

    return hook


def replicate_parameters(module: nn.Module, tp_mesh: DeviceMesh, within: Sequence[str] | None = None) -> None:
    """Every parameter of `module` that is not a DTensor yet becomes a replicated DTensor on `tp_mesh`
    (as SequenceParallel does for a norm's), keeping tied parameters tied; with `within`, only the parameters of
    those modules (FQNs): a per-head norm inside a split region, whose gradient each rank computes from its own
    heads (Partial, summed by reduce_partial_gradients)."""
    from torch.distributed.tensor import DTensor

    replaced: dict[int, nn.Parameter] = {}
    for prefix, owner in module.named_modules():
        if within is not None and not any(prefix == u or prefix.startswith(u + ".") for u in within):
            continue
        for name, param in list(owner._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(DTensor.from_local(param.data, tp_mesh, [Replicate()],
                                                                      run_check=False),
                                                   requires_grad=param.requires_grad)
            owner.register_parameter(name, replaced[id(param)])


@torch.no_grad()
def reduce_partial_gradients(module: nn.Module) -> None:
    """Give every tensor-parallel gradient its parameter's placements: a replicated parameter that met a
    sequence shard (a norm's weight) gets one part of its gradient per rank (Partial: summed here), and a
    sharded one may come back in another layout (a vocabulary-parallel embedding in a pipeline stage). After
    backward, before the optimizer and TiedGradients (which add this rank's local gradients)."""
    from torch.distributed.tensor import DTensor

    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


def outputs_to_plain(module: nn.Module, args: tuple, output):
    """A forward hook: every DTensor in the output becomes the plain full tensor (all-gathered when sharded),
    but logits sharded on their last dimension (the vocabulary-parallel head's) inside loss_parallel_context:
    the loss runs on them sharded."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t if _keep_sharded(t) else plain_tensor(t), output)


def plain_tensor(t):
    """A DTensor as the plain full tensor (all-gathered when sharded); anything else as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local(
        grad_placements=[Replicate()] * t.device_mesh.ndim)


_loss_parallel_active = False


def _keep_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return _loss_parallel_active and isinstance(t, DTensor) and t.ndim >= 2 and \
        tuple(t.placements) == (Shard(t.ndim - 1),)


@contextlib.contextmanager
def loss_parallel_context(enabled: bool) -> Iterator[None]:
    """Around forward and backward: the vocabulary-parallel head's logits reach the loss sharded and the
    cross-entropy runs on the shards (torch.distributed.tensor.parallel.loss_parallel)."""
    global _loss_parallel_active
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    _loss_parallel_active = True
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_active = False


LOSS_PARALLEL_FAILURES = (NotImplementedError, RuntimeError, ValueError, AssertionError)
"""What DTensor raises for an op it cannot run on vocabulary-sharded logits (no sharding strategy, or one
loss_parallel rejects)."""


class ParallelLoss:
    """The loss of a model whose logits may arrive sharded on the vocabulary (loss_parallel_context). A
    loss_fn that cannot run on them (an op DTensor has no rule for) runs on the gathered logits instead, from
    then on, and says so once (the plan's disable_loss_parallel avoids the attempt)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn, self.sharded = loss_fn, True

    def __call__(self, output, targets) -> torch.Tensor:
        from torch.utils import _pytree as pytree

        from autoplan.contract import compute_loss

        if self.sharded and any(_keep_sharded(t) for t in pytree.tree_leaves(output)):
            try:
                return compute_loss(self.loss_fn, output, targets)
            except LOSS_PARALLEL_FAILURES as e:
                self.sharded = False
                print(f"loss parallel: the loss cannot run on vocabulary-sharded logits ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); gathering the logits instead", flush=True)
        return compute_loss(self.loss_fn, pytree.tree_map(plain_tensor, output), targets)


def _stage_plan(stage: fx.GraphModule, plan: Mapping[str, str], chain_modules: Sequence[str]) -> dict[str, str]:
    """The part of the plan inside a stage's chain modules, its Linears restored as modules."""
    def in_stage(fqn: str) -> bool:
        return any(fqn == u or fqn.startswith(u + ".") or not u for u in chain_modules)

    replicated = {fqn for fqn, style in plan.items() if style in ("replicate", "sequence_local") and in_stage(fqn)}
    wanted = {fqn for fqn in plan if in_stage(fqn)} - replicated  # modules kept as calls: no Linear to restore
    present = {fqn for fqn in wanted if isinstance(_maybe_submodule(stage, fqn), (nn.Linear, nn.Embedding))}
    missing = wanted - present - restore_linears(stage, wanted - present)  # a module the stage calls holds its own
    if missing:
        raise UserError(f"tensor parallel: {', '.join(sorted(map(repr, missing)))} run no linear op in the "
                        "exported graph of their stage (not an nn.Linear, or its chain module was inlined)")
    return {fqn: plan[fqn] for fqn in wanted | replicated}


def _maybe_submodule(module: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return module.get_submodule(fqn)
    except AttributeError:
        return None


@contextlib.contextmanager
def tensor_parallel_context(enabled: bool) -> Iterator[None]:
    """Around forward and backward: plain tensors meeting DTensors count as replicated; those that need a
    gradient enter through DTensor.from_local (ReplicatedOperands), so their gradient comes back a plain tensor."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication(), ReplicatedOperands():
        yield


def _plain_activation(t) -> bool:
    """A plain tensor computed by autograd (not a parameter: a plain parameter meeting DTensors keeps the DTensor
    gradient implicit replication gives it, which reduce_partial_gradients and the optimizer take)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.requires_grad and t.grad_fn is not None


class ReplicatedOperands(torch.overrides.TorchFunctionMode):
    """A plain tensor that needs a gradient meeting DTensors of one tensor-parallel mesh in an op (DeepSeek-V3's
    shared rotary key, computed by a Linear left whole, copied into every head of the split keys) enters as a
    replicated DTensor through DTensor.from_local: its gradient (this rank's heads' share, or whole) is made whole
    over the ranks and comes back plain. implicit_replication alone would hand it a DTensor gradient, which the
    plain tensors before it (a to_local's backward) cannot take. Tables without gradients (rotary cos/sin, masks)
    and parameters stay implicit."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        from torch.utils import _pytree as pytree

        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        meshes = {t.device_mesh for t in leaves if isinstance(t, DTensor)}
        if len(meshes) == 1 and any(_plain_activation(t) for t in leaves):
            mesh = next(iter(meshes))

            def replicated(t):
                if _plain_activation(t):
                    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
                return t

            args, kwargs = pytree.tree_map(replicated, (args, kwargs))
        return func(*args, **kwargs)


_MODULE_OPS = {"linear": (0, 1, slice(1, 3)), "embedding": (1, 0, slice(0, 1)), "conv1d": (1, 2, slice(0, 3, 2))}
"""kind -> (index of the input, of the weight, slice of the parameters) in its op's arguments."""


class Conv1D(nn.Module):
    """transformers' Conv1D as a stage graph runs it: addmm(bias, x, weight [in, out]) on a 2-D input."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter) -> None:
        super().__init__()
        self.nf = weight.shape[1]
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def _op_kind(node: fx.Node) -> str | None:
    """"linear", "embedding" or "conv1d" for an aten.linear / aten.embedding call or an aten.addmm of a
    module's bias and weight, else None."""
    if node.op != "call_function":
        return None
    for kind, op in (("linear", torch.ops.aten.linear.default), ("embedding", torch.ops.aten.embedding.default)):
        if node.target is op:
            return kind
    if node.target is torch.ops.aten.addmm.default and len(node.args) == 3 and all(
            isinstance(node.args[i], fx.Node) and node.args[i].op == "get_attr" for i in (0, 2)):
        return "conv1d"
    return None


def restore_linears(module: nn.Module, fqns: set[str]) -> set[str]:
    """Turn aten.linear (aten.embedding) calls of the Linears (Embeddings) named in `fqns` (FQNs in `module`)
    back into nn.Linear (nn.Embedding) submodules that hold the same parameters. Returns the FQNs restored.

    A Linear lies inside a chain module's GraphModule (chain module "blocks.0", weight "attn.qkv.weight"), in the
    stage's own graph (an inlined chain module), or is a chain module itself (chain module "blocks.0.attn.qkv", weight
    "weight"): then the chain module's GraphModule is replaced by the Linear in the graph that calls it."""
    restored = set()
    whole_chain_modules = []
    for prefix, graph_module in list(module.named_modules()):
        if not isinstance(graph_module, fx.GraphModule):
            continue
        changed = False
        for node in list(graph_module.graph.nodes):
            kind = _op_kind(node)
            if kind is None:
                continue
            weight = node.args[_MODULE_OPS[kind][1]]
            if not isinstance(weight, fx.Node) or weight.op != "get_attr" or weight.target.rpartition(".")[2] != "weight":
                continue
            path = weight.target.rpartition(".")[0]
            fqn = ".".join(part for part in (prefix, path) if part)
            if fqn not in fqns:
                continue
            if path:
                _linear_node_to_module(graph_module, node, path, fqn)
                changed = True
            else:
                whole_chain_modules.append((prefix, graph_module, node))
            restored.add(fqn)
        if changed:
            graph_module.recompile()
    for prefix, chain_module, node in whole_chain_modules:
        _linear_chain_module_to_module(module, prefix, chain_module, node)
    return restored


def _linear_node_to_module(graph_module: fx.GraphModule, node: fx.Node, path: str, fqn: str) -> None:
    params = _linear_parameters(node, fqn)
    linear = _as_linear(graph_module.get_submodule(path), node, fqn)
    parent_path, _, leaf = path.rpartition(".")
    setattr(graph_module.get_submodule(parent_path) if parent_path else graph_module, leaf, linear)
    with graph_module.graph.inserting_before(node):
        call = graph_module.graph.call_module(path, (node.args[_MODULE_OPS[_op_kind(node)][0]],))
    node.replace_all_uses_with(call)
    graph_module.graph.erase_node(node)
    for param in params:
        graph_module.graph.erase_node(param)


def _linear_chain_module_to_module(root: nn.Module, path: str, chain_module: fx.GraphModule, node: fx.Node) -> None:
    """Replace the chain module GraphModule at `path` (in `root`), which runs only the linear `node`, by an
    nn.Linear, and its call (chain module calls return a tuple) by a call of the Linear."""
    _linear_parameters(node, path)
    ops = [n for n in chain_module.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    inputs = [n for n in chain_module.graph.nodes if n.op == "placeholder"]
    output = next(n for n in chain_module.graph.nodes if n.op == "output")
    if ops != [node] or inputs != [node.args[_MODULE_OPS[_op_kind(node)][0]]] or tuple(output.args[0]) != (node,):
        raise UserError(f"tensor parallel: chain module {path!r} runs more than its Linear in the exported graph, "
                        "so it cannot be sharded as a Linear")
    caller_path, target, calls = _callers(root, path)
    if len(calls) != 1:
        raise UserError(f"tensor parallel: chain module {path!r} is called {len(calls)} times in its stage, "
                        "expected once")
    (call,) = calls
    linear = _as_linear(chain_module, node, path)
    parent_path, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, leaf, linear)
    caller = root.get_submodule(caller_path)
    with caller.graph.inserting_before(call):
        direct = caller.graph.call_module(target, call.args)
    for user in list(call.users):  # getitem(call, 0): the chain module returned (linear,)
        user.replace_all_uses_with(direct)
        caller.graph.erase_node(user)
    caller.graph.erase_node(call)
    caller.recompile()


def _linear_parameters(node: fx.Node, fqn: str) -> list[fx.Node]:
    """The weight and bias get_attr nodes of a linear (embedding) op, which must read them alone."""
    params = [p for p in node.args[_MODULE_OPS[_op_kind(node)][2]] if p is not None]
    if any(len(p.users) != 1 for p in params):
        raise UserError(f"tensor parallel: the weight of {fqn!r} is also used outside its Linear (tied?), "
                        "so it cannot be sharded as a Linear")
    return params


def _as_linear(holder: nn.Module, node: fx.Node, fqn: str) -> nn.Linear | nn.Embedding:
    """An nn.Linear (nn.Embedding) holding the (meta or real) weight and bias of `holder` that `node` reads."""
    extra = (set(dict(holder.named_parameters())) | set(dict(holder.named_buffers()))) - {"weight", "bias"}
    if extra:
        raise UserError(f"tensor parallel: {fqn!r} holds more than a Linear's weight and bias: {sorted(extra)}")
    if _op_kind(node) == "conv1d":
        return Conv1D(holder.weight, holder.bias)
    if _op_kind(node) == "embedding":
        padding_idx = node.args[2] if len(node.args) > 2 and node.args[2] != -1 else None
        embedding = nn.Embedding(*holder.weight.shape, padding_idx=padding_idx, device="meta")
        embedding.weight = holder.weight
        return embedding
    bias = node.args[2] if len(node.args) > 2 else None
    linear = nn.Linear(holder.weight.shape[1], holder.weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = holder.weight
    if bias is not None:
        linear.bias = getattr(holder, bias.target.rpartition(".")[2])
    return linear


def _callers(root: nn.Module, path: str) -> tuple[str, str, list[fx.Node]]:
    """The GraphModule that calls the module at `path`, the call's target there, and the calls."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        caller_path, target = ".".join(parts[:i]), ".".join(parts[i:])
        caller = root.get_submodule(caller_path)
        if isinstance(caller, fx.GraphModule):
            calls = [n for n in caller.graph.nodes if n.op == "call_module" and n.target == target]
            if calls:
                return caller_path, target, calls
    return "", path, []


_registered = False


def _register_cpu_attention_sharding() -> None:
    """DTensor has sharding rules for the CUDA attention kernels but not for the CPU one that
    scaled_dot_product_attention dispatches to. Attention is independent per batch element and
    per head, so shard on either (or replicate); a mask is replicated along a dim it broadcasts."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    def mask_placement(mask, dim: int):
        offset = dim - (4 - len(mask.shape))  # the mask broadcasts against (batch, heads, q, k)
        return Shard(offset) if offset >= 0 and mask.shape[offset] > 1 else Replicate()

    def strategies(outputs: int, tensors: int, scalars: int, mask):
        result = []
        for placement in (Replicate(), Shard(0), Shard(1)):
            if placement == Replicate():
                masks = [Replicate()] if mask is not None else []
            else:
                masks = [mask_placement(mask, placement.dim)] if mask is not None else []
            result.append(([placement] * outputs, [placement] * tensors + [None] * scalars + masks))
        return result

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return strategies(outputs=2, tensors=3, scalars=2, mask=attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        return strategies(outputs=3, tensors=6, scalars=2, mask=attn_mask)

    _registered = True
