"""Tensor parallelism (Megatron-style) with torch.distributed.tensor.parallel.parallelize_module.

The plan maps nn.Linear FQNs to "colwise" or "rowwise" (pairs such as qkv -> proj, fc -> proj).
The model is the user's unmodified code, whose reshapes may hard-code the head count
(view(b, t, n_head, c // n_head)). So a column-parallel Linear returns a DTensor
(use_local_output=False): the ops up to the row-parallel Linear see global shapes and DTensor keeps
each rank's shard (heads split along the sharded dim), and the row-parallel Linear all-reduces back
to a plain replicated tensor. Plain tensors that meet a DTensor on the way (rotary cos/sin, masks)
count as replicated (implicit_replication, around forward and backward: tensor_parallel_context).

Pipeline stages are exported graphs, where a Linear is an aten.linear call: restore_linears turns
the planned ones back into nn.Linear submodules at the same FQN so parallelize_module applies.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.errors import UserError

STYLES = ("colwise", "rowwise")


def tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str],
                    units: Sequence[str] = ()) -> nn.Module:
    """Shard the planned Linears of `module` over the tensor-parallel mesh (in place). For a
    pipeline stage (an exported graph running `units`), the planned Linears inside its units."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not plan or tp_mesh.size() == 1:
        return module
    _register_cpu_attention_sharding()
    if isinstance(module, fx.GraphModule):
        plan = _stage_plan(module, plan, units)
    styles = {}
    for fqn, style in plan.items():
        try:
            layer = module.get_submodule(fqn)
        except AttributeError:
            raise UserError(f"the tensor-parallel plan names {fqn!r}, which the model does not have") from None
        if not isinstance(layer, nn.Linear):
            raise UserError(f"the tensor-parallel plan names {fqn!r}, a {type(layer).__name__}, not an nn.Linear")
        if style not in STYLES:
            raise UserError(f"tensor-parallel style of {fqn!r} must be one of {STYLES}, got {style!r}")
        parts = layer.out_features if style == "colwise" else layer.in_features
        if parts % tp_mesh.size():
            dim = "output" if style == "colwise" else "input"
            raise UserError(f"{fqn!r} has {parts} {dim} features, not divisible by tp {tp_mesh.size()}")
        styles[fqn] = (ColwiseParallel(use_local_output=False) if style == "colwise"
                       else RowwiseParallel(input_layouts=Shard(-1)))
    parallelize_module(module, tp_mesh, styles)
    return module


def _stage_plan(stage: fx.GraphModule, plan: Mapping[str, str], units: Sequence[str]) -> dict[str, str]:
    """The part of the plan inside a stage's units, its Linears restored as modules."""
    def in_stage(fqn: str) -> bool:
        return any(fqn == u or fqn.startswith(u + ".") or not u for u in units)

    wanted = {fqn for fqn in plan if in_stage(fqn)}
    missing = wanted - restore_linears(stage, wanted)
    if missing:
        raise UserError(f"tensor parallel: {', '.join(sorted(map(repr, missing)))} run no linear op in the "
                        "exported graph of their stage (not an nn.Linear, or its unit was inlined)")
    return {fqn: plan[fqn] for fqn in wanted}


@contextlib.contextmanager
def tensor_parallel_context(enabled: bool) -> Iterator[None]:
    """Around forward and backward: plain tensors meeting DTensors count as replicated."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        yield


def restore_linears(module: nn.Module, fqns: set[str]) -> set[str]:
    """Turn aten.linear calls of the Linears named in `fqns` (FQNs in `module`) back into nn.Linear
    submodules that hold the same parameters. Returns the FQNs restored."""
    restored = set()
    for prefix, graph_module in list(module.named_modules()):
        if not isinstance(graph_module, fx.GraphModule):
            continue
        changed = False
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
                continue
            weight = node.args[1]
            if not isinstance(weight, fx.Node) or weight.op != "get_attr" or not weight.target.endswith(".weight"):
                continue
            path = weight.target.rpartition(".")[0]
            fqn = f"{prefix}.{path}" if prefix else path
            if fqn in fqns:
                _linear_node_to_module(graph_module, node, path, fqn)
                restored.add(fqn)
                changed = True
        if changed:
            graph_module.recompile()
    return restored


def _linear_node_to_module(graph_module: fx.GraphModule, node: fx.Node, path: str, fqn: str) -> None:
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    params = [p for p in (weight, bias) if p is not None]
    if any(len(p.users) != 1 for p in params):
        raise UserError(f"tensor parallel: the weight of {fqn!r} is also used outside its Linear (tied?), "
                        "so it cannot be sharded as a Linear")
    holder = graph_module.get_submodule(path)
    extra = (set(dict(holder.named_parameters())) | set(dict(holder.named_buffers()))) - {"weight", "bias"}
    if extra:
        raise UserError(f"tensor parallel: {fqn!r} holds more than a Linear's weight and bias: {sorted(extra)}")
    linear = nn.Linear(holder.weight.shape[1], holder.weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = holder.weight
    if bias is not None:
        linear.bias = getattr(holder, bias.target.rpartition(".")[2])
    parent_path, _, leaf = path.rpartition(".")
    setattr(graph_module.get_submodule(parent_path) if parent_path else graph_module, leaf, linear)
    with graph_module.graph.inserting_before(node):
        call = graph_module.graph.call_module(path, (node.args[0],))
    node.replace_all_uses_with(call)
    graph_module.graph.erase_node(node)
    for param in params:
        graph_module.graph.erase_node(param)


_registered = False


def _register_cpu_attention_sharding() -> None:
    """DTensor has sharding rules for the CUDA attention kernels but not for the CPU one that
    scaled_dot_product_attention dispatches to. Attention is independent per batch element and
    per head, so shard on either (or replicate); a mask is replicated along a dim it broadcasts."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import Replicate, Shard
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
