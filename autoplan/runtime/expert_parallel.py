"""Expert parallelism: shard a mixture of experts' expert weights over ranks and send each token to the
rank that holds its expert, as torchtitan does (all-to-all dispatch, local expert compute, all-to-all
combine).

An experts module is what transformers' MoE families (Mixtral, Qwen2-MoE, OLMoE, ...) call after the
router: `experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`, whose
parameters are stacked per expert on dimension 0 (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) and
whose `num_experts` says E. `shard_experts` keeps rank r's E/ep experts on each of the ep ranks of a
group (the module's own parameters, sliced, under their own names) and replaces its forward by:

1. every (token, slot) pair goes to the rank holding its expert: one all-to-all of the hidden states with
   uneven splits (and one of the expert ids);
2. that rank runs the module's own forward (any experts implementation transformers offers) on what it
   received, each row its own token with weight 1;
3. a second all-to-all brings the rows back, and the sender weights them by the router's top-k weights and
   adds them up per token (so the router's gradient stays on the sender).

Both all-to-alls are autograd functions (torch's functional collectives), so backward retraces the route.
The ep ranks hold different data (ep borrows ranks from data parallelism): a rank's expert gradients
sum the contributions of every token of the group routed to its experts.

In the generated program, autoplan.parallelize calls parallelize_experts before FSDP2 (with a pipeline, on this
rank's stages, which call the experts modules as modules: runtime/expert_calls.py): the sliced parameters
become DTensors sharded on dimension 0 over the expert mesh's "ep" dimension (so the initial values' broadcast
gives each rank its slice, and a torch.distributed.checkpoint holds each expert once at the model's full shape),
FSDP2 leaves them out (ignored_params), and after backward ExpertParallel.reduce_gradients sums them over the
dp/ep replicas and divides by dp. Unlike torchtitan, the replicas hold the experts whole (not FSDP-sharded over
dp_mod_ep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autoplan.capture.experts import is_experts_module
from autoplan.errors import UserError


@dataclass(frozen=True)
class ExpertShard:
    """The experts one rank holds."""

    num_experts: int
    """Experts in the model's module (E)."""
    degree: int
    """Expert-parallel ranks sharing them (ep)."""
    rank: int
    """This rank's index in the expert-parallel group."""

    @property
    def local(self) -> int:
        """Experts per rank (E / ep)."""
        return self.num_experts // self.degree

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local


def shard_experts(module: nn.Module, group: dist.ProcessGroup) -> ExpertShard:
    """Keep this rank's experts of `module` and make its forward route tokens over `group`."""
    if not is_experts_module(module):
        raise ValueError(f"{type(module).__name__} is not an experts module (num_experts and weight matrices "
                         f"stacked per expert on dimension 0)")
    shard = ExpertShard(module.num_experts, dist.get_world_size(group), dist.get_rank(group))
    if shard.num_experts % shard.degree:
        raise ValueError(f"cannot split {shard.num_experts} experts into {shard.degree} equal shares")
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach()[shard.first:shard.first + shard.local].clone()
        setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))
    module.num_experts = shard.local
    local_forward = module.forward

    def routed_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        return _route(local_forward, shard, group, hidden_states, top_k_index, top_k_weights)

    module.forward = routed_forward
    return shard


def _route(local_forward, shard: ExpertShard, group: dist.ProcessGroup, hidden_states: torch.Tensor,
           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    tokens, slots = top_k_index.shape
    expert = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=expert.device).repeat_interleave(slots)
    destination = torch.div(expert, shard.local, rounding_mode="floor")
    order = torch.argsort(destination, stable=True)
    send = torch.bincount(destination, minlength=shard.degree)
    receive = _waited(all_to_all_single(send, [1] * shard.degree, [1] * shard.degree, group))
    send_sizes, receive_sizes = send.tolist(), receive.tolist()
    rows = all_to_all_single_autograd(hidden_states[token[order]], receive_sizes, send_sizes, group)
    local_expert = all_to_all_single(expert[order] - destination[order] * shard.local, receive_sizes, send_sizes,
                                     group)
    local_expert = _waited(local_expert)
    outputs = local_forward(rows, local_expert.reshape(-1, 1), torch.ones(len(rows), 1, dtype=top_k_weights.dtype,
                                                                         device=rows.device))
    back = all_to_all_single_autograd(outputs, send_sizes, receive_sizes, group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
    combined = torch.zeros_like(hidden_states)
    return combined.index_add(0, token[order], (back * weights).to(combined.dtype))


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for (an AsyncCollectiveTensor until then)."""
    wait = getattr(tensor, "wait", None)
    return wait() if callable(wait) else tensor


EXPERT_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "tp")
"""The expert mesh: the data-parallel dimension cut into ep groups of consecutive data-parallel ranks (which
split the experts among them) and dp/ep replicas of each (which hold the same experts), as torchtitan
borrows ep from data parallelism. Its ranks are numbered as the plan's mesh numbers them (runtime/mesh.py:
pp, then data parallel, then tp), so a rank's data-parallel index is dp_mod_ep index x ep + ep index."""


def expert_mesh(device_type: str, pp: int, dp: int, ep: int, tp: int = 1):
    """The mesh EXPERT_MESH_DIMS over every process (all of them call it, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp % ep:
        raise ValueError(f"expert parallel borrows its ranks from data parallelism: ep {ep} must divide dp {dp}")
    return init_device_mesh(device_type, (pp, dp // ep, ep, tp), mesh_dim_names=EXPERT_MESH_DIMS)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of every experts module in `module` (those data parallelism must leave alone)."""
    return [param for sub in module.modules() if is_experts_module(sub) for param in sub.parameters(recurse=False)]


@torch.no_grad()
def reduce_expert_gradients(params, replicas: dist.ProcessGroup | None, dp: int) -> None:
    """After backward: each expert gradient holds what its ep group's tokens contributed (the all-to-all
    brought them); summed over the replicas of those experts it holds every data-parallel rank's, and divided
    by dp it is the gradient of the global batch's mean loss, as data parallelism averages the others. A DTensor
    gradient (parallelize_experts' parameters) is reduced in its local tensor: the rank's own experts."""
    for param in params:
        if param.grad is None:
            continue
        grad = _local_tensor(param.grad)
        if replicas is not None and dist.get_world_size(replicas) > 1:
            dist.all_reduce(grad, group=replicas)
        grad.div_(dp)


@dataclass
class ExpertParallel:
    """A model's experts split over expert-parallel groups (parallelize_experts), and what backward leaves to do."""

    params: list[nn.Parameter]
    """This rank's expert parameters: DTensors sharded on dimension 0 over the expert mesh's "ep" dim (its
    slice of each stacked weight), so a checkpoint holds every expert once under the model's own names."""
    replicas: dist.ProcessGroup | None
    """The ranks holding the same experts (dp/ep of them; None when ep = dp)."""
    dp: int
    """Data-parallel ranks (the expert gradients are divided by it, as data parallelism averages the others)."""

    def reduce_gradients(self) -> None:
        """After backward: sum the expert gradients over the replicas and divide by dp."""
        reduce_expert_gradients(self.params, self.replicas, self.dp)


def parallelize_experts(module: nn.Module, device_type: str, dp: int, ep: int,
                        dtype: torch.dtype = torch.float32, pp: int = 1) -> ExpertParallel:
    """Split every experts module of `module` over groups of ep consecutive data-parallel ranks (torchtitan's ep
    borrowed from dp; call on every rank, before FSDP, which must leave ExpertParallel.params alone). Works on
    the meta device: each parameter becomes a DTensor of the full shape, Shard(0) over the "ep" dim of an
    expert mesh (pp, dp/ep, ep, tp 1), whose local tensor is this rank's experts; its forward runs on the
    local tensors (cast to `dtype`), routing tokens with all-to-all (shard_experts). With a pipeline (pp > 1)
    `module` holds this rank's stages, whose experts modules split over the data-parallel ranks of the same
    pipeline rank; a stage may hold none."""
    from torch.distributed.tensor import DTensor, Shard

    if ep == 1:
        return ExpertParallel([], None, dp)
    experts = [sub for sub in module.modules() if is_experts_module(sub)]
    if not experts and pp == 1:
        raise UserError(f"ep={ep}, but {type(module).__name__} has no experts module (num_experts and weights "
                        f"stacked per expert on dimension 0) to split: plan it with ep=1")
    mesh = expert_mesh(device_type, pp, dp, ep)  # every rank builds it, with experts or not
    ep_mesh = mesh["ep"]
    params = []
    for sub in experts:
        shard_experts(sub, ep_mesh.get_group())
        for name, param in list(sub.named_parameters(recurse=False)):
            sharded = DTensor.from_local(param.detach(), ep_mesh, [Shard(0)], run_check=False)
            setattr(sub, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            params.append(getattr(sub, name))
        _compute_on_local_tensors(sub, dtype)
    replicas = mesh["dp_mod_ep"].get_group() if dp // ep > 1 else None
    return ExpertParallel(params, replicas, dp)


def _compute_on_local_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    """Run `module`'s forward with its DTensor parameters replaced by their local tensors (differentiable: the
    gradients reach the DTensors), cast to `dtype`."""
    routed = module.forward

    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        try:
            for name, param in saved.items():
                if param is not None:
                    module._parameters[name] = param.to_local().to(dtype)
            return routed(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (sharing its storage), else the tensor."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
