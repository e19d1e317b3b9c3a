"""The weight-gradient pass of the zero-bubble schedules, completed for stage outputs no received input reaches.

torch.distributed.pipelining's split backward (stage_backward_input, then stage_backward_weight) computes a
stage's weight gradients only along the paths from its outputs that pass through an op reached from a stage
input requiring gradient (its "intermediates"): the input-gradient pass records the gradient at each such op and
the weight pass resumes from there. A path from an output that no such input reaches is taken by neither pass.
torch covers the case only for stage 0 (its whole backward in the W pass). On any other stage those weights lose
that gradient, or get none: a stage holding a second copy of a tied embedding that reads only the token ids (BART's
decoder embed_tokens beside the encoder's last layer) ends a step with no gradient on it; the copy's sum over the
tied stages then misses it.

SplitBackwardStage records, in the input pass, the stage outputs that no input requiring gradient reaches and their
output gradients, and in the weight pass takes the gradient of the stage's weights from them too. The two parts
are disjoint: an op downstream of an input is never upstream of such an output (it would be reached from the
input), so no gradient is counted twice.

With data parallelism the stage reduces its gradients once, after its last weight pass (torch's REDUCE_GRAD action,
perform_reduce_grad), and no earlier. torch's own handling does not: it lets DDP's reducer start in the last
backward, whose autograd.grad calls never fire DDP's hooks (the replicas' gradients stay unreduced), reduces only a
stage module that is itself the FSDP module (not one under a dtype cast), and computes each pass against
`submod.parameters()`, which under ZeRO-3 (FSDP2 resharding after forward) are the sharded parameters rather than
the gathered ones the autograd graph used (their gradients are then lost). So:
- a stage DDP would replicate is not wrapped in DDP (apply_plan; its buckets would be a second, unused copy of
  the gradients): perform_reduce_grad all-reduces the accumulated gradients over the replicas itself, in buckets
  of DDP's default size, averaged as DDP does;
- an FSDP2 stage (ZeRO-2/3, HSDP, or replicated beside tensor parallelism) gathers its parameters before each pass
  (a no-op when they are gathered) and keeps gradient sync off until perform_reduce_grad, which runs FSDP2's
  post-backward (reduce-scatter, all-reduce over HSDP replicas) and reshards.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, reverse_closure
from torch.utils import _pytree as pytree

UNREACHED = "autoplan_unreached_outputs"
"""The key of the entry SplitBackwardStage adds to torch's param groups: the outputs the input pass did not take."""


def unreached_outputs(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None] | None,
                      inputs: Sequence[Any]) -> list[tuple[GradientEdge, torch.Tensor]]:
    """(edge, gradient) of each output with a gradient that no input requiring gradient reaches through the
    autograd graph. `output_grads` None: `outputs` is the loss (gradient one)."""
    edges: list[tuple[Node, torch.Tensor]] = []
    for index, output in enumerate(outputs):
        if not isinstance(output, torch.Tensor) or (not output.requires_grad and output.grad_fn is None):
            continue
        grad = torch.ones_like(output) if output_grads is None else output_grads[index]
        node = _get_grad_fn_or_grad_acc(output)
        if grad is not None and node is not None:
            edges.append((GradientEdge(node, output.output_nr if output.grad_fn is not None else 0), grad))
    if not edges:
        return []
    input_nodes = [node for node in (_get_grad_fn_or_grad_acc(t) for t in inputs
                                     if isinstance(t, torch.Tensor) and t.requires_grad) if node is not None]
    reverse = construct_reverse_graph([edge.node for edge, _ in edges])
    reached, _ = reverse_closure(input_nodes, set(), reverse)
    return [(edge, grad) for edge, grad in edges if edge.node not in reached]


def weight_gradients_from(unreached: Sequence[tuple[GradientEdge, torch.Tensor]],
                          weights: Sequence[torch.nn.Parameter]) -> None:
    """Accumulate into the weights' .grad their gradient through the `unreached` outputs (the graph is kept
    for torch's weight pass, which runs next and may share ops with these paths)."""
    weights = [w for w in weights if w.requires_grad]
    if not unreached or not weights:
        return
    grads = torch.autograd.grad([edge for edge, _ in unreached], weights, grad_outputs=[g for _, g in unreached],
                                retain_graph=True, allow_unused=True)
    for weight, grad in zip(weights, grads):
        if grad is None:
            continue
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad += grad


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2-managed modules in `module` (itself included), root first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def gather_parameters(module: nn.Module) -> None:
    """Unshard every FSDP2 module in `module` (FSDPModule.unshard is not recursive), so that `module.parameters()` are
    the gathered parameters the autograd graph holds."""
    for fsdp in fsdp_modules(module):
        fsdp.unshard()


def reduce_fsdp_gradients(module: nn.Module) -> None:
    """FSDP2's post-backward for every FSDP module in `module`, gradient sync on: reduce-scatter (and all-reduce over
    HSDP replicas) the gradients accumulated in the gathered parameters, then reshard (torch's perform_reduce_grad,
    for a root that is not the stage module)."""
    from torch.distributed.fsdp import fully_shard

    roots = fsdp_modules(module)[:1]
    for root in roots:
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = fully_shard.state(root)
        for member in state._state_ctx.all_states:
            for group in member._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


REDUCE_BUCKET_BYTES = 25 * 2**20
"""Gradient bytes all-reduced in one call: DDP's default bucket_cap_mb (25 MiB), as the cost model's buckets."""


def buckets(grads: Sequence[torch.Tensor], bucket_bytes: int = REDUCE_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into runs of one dtype of at most `bucket_bytes` (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if not out or out[-1][0].dtype != grad.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(grad)
        size += nbytes
    return out


@torch.no_grad()
def all_reduce_mean(params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Average the gradients of `params` (the same parameters in the same order on every member of `group`) over
    `group` in place, one flat all-reduce per bucket. A parameter without a gradient on some members (none reached
    it there) takes the mean with zeros for them; one without a gradient on every member keeps none."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    params = [p for p in params if p.requires_grad]
    if not params:
        return
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    dist.all_reduce(present, group=group)
    grads = []
    for param, members in zip(params, present.tolist()):
        if members > 0:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    size = dist.get_world_size(group)
    for bucket in buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat /= size
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


class SplitBackwardStage(PipelineStage):
    """A PipelineStage whose weight-gradient pass also takes the outputs no input reaches, and whose data-parallel
    gradients are reduced once, after the last weight pass (module docstring). `data_parallel`: the stage's FSDP2
    module when `submodule` wraps it (a dtype cast); default `submodule`. `replicas`: the group to average the
    gradients over in place of DDP (not with FSDP2); None: no replicas."""

    def __init__(self, submodule: nn.Module, *args: Any, data_parallel: nn.Module | None = None,
                 replicas: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(submodule, *args, **kwargs)
        self.data_parallel = submodule if data_parallel is None else data_parallel
        if isinstance(self.data_parallel, DistributedDataParallel):
            raise ValueError("a zero-bubble stage reduces its gradients itself (replicas=), not under DDP, whose "
                             "reducer its weight-gradient passes never start")
        if replicas is not None and fsdp_modules(self.data_parallel):
            raise ValueError("a zero-bubble stage under FSDP2 is reduced by FSDP2, not over replicas= as well")
        self.replicas = replicas
        self.reduced = False
        """Whether perform_reduce_grad ran since the stage's last backward pass."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False):
        self.reduced = False
        gather_parameters(self.data_parallel)
        for module in fsdp_modules(self.data_parallel)[:1]:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        return self._backward(backward_type, bwd_kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.replicas is not None:
            all_reduce_mean(list(self.submod.parameters()), self.replicas)
        reduce_fsdp_gradients(self.data_parallel)
        self.reduced = True
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)

    def _backward(self, backward_type: str, bwd_kwargs: dict):
        """torch's pass, without its data-parallel handling (last_backward False)."""
        if backward_type == "input":
            outputs = bwd_kwargs["stage_output"]
            flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            grads = bwd_kwargs["output_grads"]
            flat_grads = None if grads is None else list(grads) if isinstance(grads, (tuple, list)) else [grads]
            unreached = unreached_outputs(flat, flat_grads, pytree.tree_leaves(bwd_kwargs["input_values"]))
            input_grads, param_groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)
            if unreached:
                param_groups = [*param_groups, {UNREACHED: unreached}]
            return input_grads, param_groups
        if backward_type == "weight":
            groups = bwd_kwargs["param_groups"] or []
            for group in groups:
                if UNREACHED in group:
                    weight_gradients_from(group[UNREACHED], list(self.submod.parameters()))
            bwd_kwargs = {**bwd_kwargs, "param_groups": [g for g in groups if UNREACHED not in g]}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=False)
