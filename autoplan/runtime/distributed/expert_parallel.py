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
The ep ranks hold different tokens (see below: one route per token): a rank's expert gradients sum the
contributions of every token of the group routed to its experts.

In the generated program, autoplan.parallelize calls parallelize_experts before FSDP2 (with a pipeline, on this
rank's stages, which call the experts modules as modules: runtime/distributed/expert_calls.py): the sliced parameters
become DTensors sharded on dimension 0 over the expert mesh's "ep" dimension (so the initial values' broadcast
gives each rank its slice, and a torch.distributed.checkpoint holds each expert once at the model's full shape).

The expert mesh is folded over the ranks of one pipeline rank and data-parallel replica, dp_shard x cp x tp, as
torchtitan and Megatron-Core fold it ("MoE parallel folding", expert-tensor-parallel 1): of those ranks, numbered
as the plan's mesh numbers them (tp innermost), each ep consecutive ones split the experts ("ep") and the
dp_shard x cp x tp / ep ranks holding the same experts ("efsdp") FSDP2-shard them (ExpertParallel.fully_shard,
from shard_data_parallel, before the modules around it), with the plan's resharding and HSDP over dp_replicate like
the other parameters. So a rank keeps 1/(dp_shard x cp x tp) of the expert states, and ep may span tensor- and
context-parallel ranks, which hold distinct tokens once every tp rank routes its own share.

One route per token (TensorParallelTokens): with tensor parallelism the experts are left out of the tensor-parallel
plan (each expert whole on its rank, ETP 1) and each tp rank routes a distinct 1/tp share of the tokens. Tokens that
arrive as DTensors on the tp mesh (sequence parallelism) are already distinct shares: each rank routes its own.
Plain tokens are the same on every tp rank (no sequence parallelism): each rank routes its 1/tp slice of the rows and
the outputs are all-gathered after, as torchtitan's ReordererSequenceParallel does. Every rank's routed tokens are
then distinct, so the all-to-all (within ep) and FSDP2's reduce-scatter (over efsdp, with HSDP's all-reduce over
dp_replicate) sum each expert's gradient over all tokens; it is divided by dp x cp, the loss terms the global mean
averages. Without FSDP2 (one data-parallel rank, cp 1) ExpertParallel.reduce_gradients sums it over efsdp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.capture.experts import is_experts_module
from autoplan.errors import UserError
from autoplan.layout import Parallelism, expert_folded_ranks


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


EXPERT_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep")
"""The expert mesh: the dp_shard x cp x tp ranks of each pipeline rank and data-parallel replica (numbered as the
plan's mesh numbers them: runtime/distributed/mesh.py, tp innermost) cut into groups of ep consecutive ranks, which split the
experts among them ("ep"), and the dp_shard x cp x tp / ep ranks holding the same experts ("efsdp", over which FSDP2
shards them), with the dp_replicate replicas beside (HSDP). A rank's index among the folded ranks,
(dp_shard index x cp + cp index) x tp + tp index, is efsdp index x ep + ep index."""


def expert_mesh(device_type: str, parallelism: Parallelism):
    """The mesh EXPERT_MESH_DIMS of `parallelism` over every process (all of them call it, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    p = parallelism
    folded = expert_folded_ranks(p.dp_shard, p.cp, p.tp)
    if folded % p.ep:
        raise ValueError(f"expert parallelism is cut from dp_shard {p.dp_shard} x cp {p.cp} x tp {p.tp} = {folded} "
                         f"ranks, which ep {p.ep} must divide ({folded} % {p.ep} = {folded % p.ep}; layout.py states "
                         f"the rule)")
    shape = (p.pp, p.dp_replicate, folded // p.ep, p.ep)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


@dataclass
class ExpertParallel:
    """A model's experts split over expert-parallel groups (parallelize_experts), and how data parallelism shards
    them (fully_shard)."""

    modules: list[nn.Module]
    """The experts modules, each parameter a DTensor sharded on dimension 0 over the expert mesh's "ep" dim (its
    slice of each stacked weight), so a checkpoint holds every expert once under the model's own names."""
    mesh: DeviceMesh | None
    """The expert mesh (EXPERT_MESH_DIMS); None without expert parallelism."""
    loss_terms: int
    """dp x cp: the ranks whose mean losses the global loss averages. Every rank routes distinct tokens, so the
    summed expert gradients are divided by it, as data parallelism averages the others."""
    sharded: bool = False
    """FSDP2 shards the experts (fully_shard was called): its reduce-scatter sums their gradients over efsdp."""

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """After backward: without FSDP2 (one data-parallel rank and cp 1, so dp x cp = 1) sum each expert's
        gradient over the efsdp ranks holding the same experts, which routed other tokens (tp > ep); FSDP2 does it
        otherwise."""
        if self.mesh is None or self.sharded or self.mesh["efsdp"].size() == 1:
            return
        group = self.mesh["efsdp"].get_group()
        for sub in self.modules:
            for param in sub.parameters(recurse=False):
                if param.grad is not None:  # a DTensor (parallelize_experts): its local experts, in place
                    local = param.grad.to_local()
                    dist.all_reduce(local, group=group)
                    local.div_(self.loss_terms)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts: "efsdp", with "dp_replicate" before it when it is more than 1
        (HSDP, as the other parameters)."""
        if self.mesh is None:
            raise ValueError("no expert parallelism: there is no expert mesh")
        if self.mesh["dp_replicate"].size() > 1:
            return self.mesh["dp_replicate", "efsdp"]
        return self.mesh["efsdp"]

    def fully_shard(self, module: nn.Module, **kwargs) -> None:
        """FSDP2 over fsdp_mesh for each experts module inside `module` (call before the modules around them are
        sharded, which then leave them alone), as torchtitan's apply_fsdp does over its expert FSDP mesh. kwargs:
        fully_shard's (reshard_after_forward, mp_policy, offload_policy) as the other parameters have them.

        Each rank's gradient of its experts sums what its ep group's tokens contributed (the all-to-all brought
        them); the reduce-scatter (and HSDP's all-reduce) sums it over the ranks holding the same experts, which
        makes every rank's contribution, so it is divided by dp x cp (not by the fsdp_mesh size, FSDP2's default) to
        be the gradient of the global batch's mean loss. FSDP2 shards dimension 0 (whole experts) when it splits the
        rank's E/ep experts evenly, else dimension 1, as torchtitan does when efsdp x ep exceeds the experts."""
        from torch.distributed.fsdp import fully_shard

        inside = {id(sub) for sub in module.modules()}
        here = [sub for sub in self.modules if id(sub) in inside]
        if not here:  # no expert parallelism, or none of the experts in this pipeline stage
            return
        self.sharded = True
        mesh = self.fsdp_mesh
        shards = mesh.size(-1)
        for sub in here:
            local = sub.num_experts  # E/ep (shard_experts)
            fully_shard(sub, mesh=mesh, shard_placement_fn=partial(_fsdp_placement, local_experts=local, shards=shards),
                        **kwargs)
            sub.set_gradient_divide_factor(float(self.loss_terms))
            # gloo has no PREMUL_SUM: sum, then divide. Not when FSDP2 shards over one rank: it then skips the
            # reduce-scatter and divides the copy by the factor, and with forced sums divides again after (torch 2.13,
            # _fsdp_collectives.foreach_reduce), which halved every expert gradient at dp_shard = ep = 2
            if mesh.device_type == "cpu" and shards > 1:
                sub.set_force_sum_reduction_for_comms(True)


def _fsdp_placement(param: nn.Parameter, local_experts: int, shards: int):
    """Shard(0) when the `shards` ranks split the `local_experts` experts evenly, else Shard(1) when they split
    dimension 1 evenly (FSDP2 requires it there), else Shard(0) padded."""
    from torch.distributed.tensor import Shard

    if local_experts % shards == 0 or param.dim() < 2 or param.shape[1] % shards:
        return Shard(0)
    return Shard(1)


def parallelize_experts(module: nn.Module, parallelism: Parallelism, device_type: str,
                        dtype: torch.dtype = torch.float32, tp_mesh: DeviceMesh | None = None) -> ExpertParallel:
    """Split every experts module of `module` over groups of ep consecutive ranks of dp_shard x cp x tp (the folded
    expert mesh, EXPERT_MESH_DIMS; call on every rank, before tensor parallelism and FSDP, which shards them over the
    ranks holding the same experts with ExpertParallel.fully_shard). Works on the meta device: each parameter becomes
    a DTensor of the full shape, Shard(0) over the expert mesh's "ep" dim, whose local tensor is this rank's experts;
    its forward runs on the local tensors (cast to `dtype`), routing tokens with all-to-all (shard_experts). With
    tp > 1, each tp rank routes its own share of the tokens over the plan's `tp_mesh` (TensorParallelTokens). With a
    pipeline (pp > 1) `module` holds this rank's stages, whose experts modules split over the ranks of the same
    pipeline rank; a stage may hold none."""
    from torch.distributed.tensor import DTensor, Shard

    p = parallelism
    loss_terms = p.dp * p.cp
    if p.ep == 1:
        if dtype != torch.float32:  # autocast leaves grouped matmuls (torch._grouped_mm) in the weights' fp32
            for sub in module.modules():
                if is_experts_module(sub):
                    _compute_on_local_tensors(sub, dtype)
        return ExpertParallel([], None, loss_terms)
    if p.tp > 1 and (tp_mesh is None or tp_mesh.size() != p.tp):
        raise ValueError(f"expert parallelism with tp={p.tp} needs the plan's tensor-parallel mesh of {p.tp} ranks")
    experts = [sub for sub in module.modules() if is_experts_module(sub)]
    if not experts and p.pp == 1:
        raise UserError(f"ep={p.ep}, but {type(module).__name__} has no experts module (num_experts and weights "
                        f"stacked per expert on dimension 0) to split: plan it with ep=1")
    mesh = expert_mesh(device_type, p)  # every rank, experts or not
    ep_mesh = mesh["ep"]
    for sub in experts:
        shard_experts(sub, ep_mesh.get_group())
        for name, param in list(sub.named_parameters(recurse=False)):
            sharded = DTensor.from_local(param.detach(), ep_mesh, [Shard(0)], run_check=False)
            setattr(sub, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        _compute_on_local_tensors(sub, dtype)
        if p.tp > 1:
            TensorParallelTokens(tp_mesh).wrap(sub)
    return ExpertParallel(experts, mesh, loss_terms)


class TensorParallelTokens:
    """One route per token under tensor parallelism (the experts are left out of the tensor-parallel plan: each
    expert stays whole on its rank, ETP 1, and the ep group may span tp ranks). The experts module's inputs are the
    tokens the tp ranks hold: this rank's own tokens as plain tensors when its MoE block runs on the rank's sequence
    shard (runtime/distributed/tensor_parallel.py run_on_local_tokens, the plan's "sequence_local" modules, which set
    `local_tokens`), routed as they are; DTensors on the tp mesh with sequence parallelism in a plan without them
    (the router ran on DTensors), each rank routing its share (Shard(0) of the (tokens, hidden) rows; the output is
    that share again); plain tensors without sequence parallelism, the same on every tp rank, of which each rank
    routes its 1/tp slice of the rows, the outputs all-gathered after (torchtitan's ReordererSequenceParallel). In
    backward the gather's gradient is each rank's slice (the ranks' gradients of replicated activations are the
    same) and the slice's gradient is all-gathered. Either way a rank's expert gradients are its tokens' share,
    summed over the ranks holding the same experts (ExpertParallel)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh
        """The plan's tensor-parallel mesh."""
        self.local_tokens = False
        """Whether the module's plain-tensor inputs are this rank's own tokens (set by run_on_local_tokens)."""

    def wrap(self, module: nn.Module) -> None:
        inner = module.forward
        module.tensor_parallel_tokens = self

        def forward(hidden_states, top_k_index, top_k_weights):
            return self(inner, hidden_states, top_k_index, top_k_weights)

        module.forward = forward

    def __call__(self, inner, hidden_states, top_k_index, top_k_weights):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        dtensor = isinstance(hidden_states, DTensor)
        if self.local_tokens and not dtensor:  # this rank's own tokens: its MoE block runs on its sequence shard
            return inner(hidden_states, top_k_index, top_k_weights)
        mesh = hidden_states.device_mesh if dtensor else self.mesh
        if mesh.ndim != 1:
            raise NotImplementedError(f"expert parallelism with tensor parallelism takes the tokens on a 1-D "
                                      f"tensor-parallel mesh, got a {mesh.ndim}-D one")
        rows = [t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                for t in (hidden_states, top_k_index, top_k_weights)]
        whole = rows[0]
        local = [t.redistribute(mesh, [Shard(0)]).to_local() for t in rows]
        out = DTensor.from_local(inner(*local), mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                 stride=whole.stride())
        return out if dtensor else out.redistribute(mesh, [Replicate()]).to_local()


def _compute_on_local_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    """Run `module`'s forward with its DTensor parameters replaced by their local tensors (differentiable: the
    gradients reach the DTensors), and every parameter cast to `dtype`: an experts module's matmuls are grouped
    (torch._grouped_mm, which autocast does not cast: transformers then casts the tokens to the fp32 weights), so
    without the cast they would run in fp32 where the plan priced the compute dtype, as torch.mm under autocast."""
    from torch.distributed.tensor import DTensor

    routed = module.forward

    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        try:
            for name, param in saved.items():
                if param is not None:
                    local = param.to_local() if isinstance(param, DTensor) else param
                    module._parameters[name] = local.to(dtype)
            return routed(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward
