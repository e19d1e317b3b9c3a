"""Data parallelism (DDP / FSDP2 / HSDP), mixed precision, tied weights across pipeline stages.

dp_shard > 1 runs FSDP2 (torch.distributed.fsdp.fully_shard) over the dp_shard ranks: with
reshard_after_forward it frees parameters after forward and gathers them again for backward (ZeRO-3);
without, it keeps them gathered from forward to backward (FSDP2 has no separate ZeRO-1/2, this is the
closest: optimizer state and gradients stay sharded). dp_shard 1 is DDP over the dp_replicate ranks.
dp_replicate x dp_shard with both > 1 is HSDP. With context parallelism (cp > 1) FSDP2 shards over
dp_shard x cp (mesh.fsdp_mesh), as torchtitan: the cp ranks hold the same samples' shares of the tokens, so
their gradients are averaged with the data-parallel ones; DDP is never used then.
"""

from __future__ import annotations

import itertools
import resource
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.layout import fsdp_wraps, stage_rank
from autoplan.runtime.distributed.config import ParallelConfig
from autoplan.runtime.distributed.expert_parallel import ExpertParallel
from autoplan.runtime.distributed.mesh import RankLayout, fsdp_mesh, local_device
from autoplan.runtime.distributed.recompute import ROOT_MODULE, submodule
from autoplan.runtime.distributed.names import WRAPPER_PREFIXES, canonical_name  # noqa: F401 (re-exported)
from autoplan.runtime.distributed.split import PipelineSplit

def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The planned training dtype on CUDA; fp32 on CPU (what `autoplan verify` checks parity in)."""
    if dtype == "bf16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def shard_data_parallel(module: nn.Module, mesh: DeviceMesh, config: ParallelConfig, chain_modules: Sequence[str],
                        dtype: torch.dtype = torch.float32, experts: ExpertParallel | None = None) -> nn.Module:
    """FSDP2 over the mesh's dp_shard x cp ranks (HSDP with dp_replicate): fully_shard each of the modules
    `chain_modules` (those of `module`, one pipeline stage or the whole model), then the root; with the layout's
    reshard (reshard_after_forward) and offload. Works on a meta-device module (materialize afterwards). With
    dp_shard 1 it is DDP (replicate_data_parallel), except with tensor parallelism: DDP buckets plain tensors, not
    DTensors, so there fully_shard over a replicate-only mesh (shard dim of size 1) replicates instead:
    full parameters on every replica, gradients all-reduced, the same work as DDP. First, with any data
    parallelism, the config's batch_norm_modules synchronize their statistics over
    the data-parallel ranks (runtime/distributed/batchnorm.py). offload: FSDP2's CPUOffloadPolicy keeps the sharded
    parameters, gradients and optimizer state in host memory (pinned on CUDA; on a CPU device torch cannot pin,
    "Cannot access accelerator device", so unpinned: the same code path with host-to-host copies).
    `experts`: expert parallelism's experts modules, FSDP2-sharded first over the ranks holding the same experts
    (ExpertParallel.fully_shard, with the same settings), so the modules around them leave them alone."""
    from autoplan.runtime.distributed.batchnorm import sync_batch_norm

    module = sync_batch_norm(module, mesh, config.batch_norm_modules)
    if not fsdp_wraps(mesh["dp_replicate"].size(), mesh["dp_shard"].size(), mesh["cp"].size(), mesh["tp"].size()):
        return module
    shard = mesh["dp_shard"].size() * mesh["cp"].size()
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dp_mesh = fsdp_mesh(mesh)
    kwargs = dict(reshard_after_forward=config.parallelism.reshard and shard > 1)
    if dtype != torch.float32:  # compute in `dtype`, reduce gradients in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if config.parallelism.offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    if experts is not None:
        experts.fully_shard(module, **kwargs)
    for path in _chain_modules_without_shared_parameters(module, chain_modules):
        if not isinstance(submodule(module, path), FSDPModule):  # a chain module that is an experts module
            fully_shard(submodule(module, path), mesh=dp_mesh, **kwargs)
    fully_shard(module, mesh=dp_mesh, **kwargs)
    return module


def ddp_replicas(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group DDP averages gradients over: the data-parallel replicas when dp_shard is 1 and there is no tensor or
    context parallelism (else FSDP2, shard_data_parallel, reduces them); None without DDP."""
    if mesh["dp_shard"].size() * mesh["cp"].size() > 1 or mesh["dp_replicate"].size() == 1 or mesh["tp"].size() > 1:
        return None
    return mesh["dp_replicate"].get_group()


def replicate_data_parallel(module: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """DDP over the data-parallel replicas (ddp_replicas). Needs materialized parameters."""
    replicas = ddp_replicas(mesh)
    if replicas is None:
        return module
    from torch.nn.parallel import DistributedDataParallel

    # gradient_as_bucket_view: gradients live in DDP's buckets, no second copy (as the cost model prices it)
    return DistributedDataParallel(module, process_group=replicas,
                                   device_ids=[local_device(device).index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def _chain_modules_without_shared_parameters(module: nn.Module, chain_modules: Sequence[str]) -> list[str]:
    """Chain modules that own all their parameters. A parameter shared by two chain modules (tied weights) must be
    managed by their common parent (FSDP2's rule), here the root."""
    chain_modules = [u for u in chain_modules if u != ROOT_MODULE]  # the root is sharded last in any case
    owners: dict[int, set[str]] = {}
    for path in chain_modules:
        for param in submodule(module, path).parameters():
            owners.setdefault(id(param), set()).add(path)
    shared = {u for paths in owners.values() if len(paths) > 1 for u in paths}
    return [u for u in chain_modules if u not in shared and any(True for _ in submodule(module, u).parameters())]


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction of this backward unless `enabled` (accumulation)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and not enabled:
        with module.no_sync():
            yield
        return
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    yield


def named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter or buffer, every name of a shared tensor included."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module = module.module
    state = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        state[canonical_name(name)] = tensor
    return state


class TiedGradients:
    """Sums the gradients of a weight's copies on several pipeline stages (Megatron's embedding
    group), so the optimizer keeps the copies identical. Stage s runs on pipeline rank
    autoplan.layout.stage_rank(s, pp, placement) (s % pp but for the V placement).
    Build it on every rank, after the stages are wrapped and materialized."""

    def __init__(self, split: PipelineSplit | None, mesh: DeviceMesh, parts: Mapping[int, nn.Module],
                 layout: RankLayout) -> None:
        self.tied: list[tuple[list[torch.Tensor], dist.ProcessGroup | None]] = []
        self.copies_counted_elsewhere: frozenset[int] = frozenset()
        """The ids of this rank's copies of tied weights on any stage but the weight's first: their (summed)
        gradient is the first stage's copy's, which a gradient norm counts once (runtime.clip_grad_norm_)."""
        if split is None:
            return
        elsewhere: set[int] = set()
        ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) -> global rank
        me, pp = dist.get_rank(), layout.pp
        states = {s: named_state(module) for s, module in parts.items()}
        for tied in split.tied:
            pp_ranks = sorted({stage_rank(s, pp, layout.placement) for s in tied.stages})
            mine = None
            for coordinate in itertools.product(*(range(n) for n in ranks.shape[1:])):  # every rank off the pp dim
                members = [int(ranks[(p, *coordinate)]) for p in pp_ranks]
                if len(members) > 1:  # every rank creates every group, in the same order
                    group = dist.new_group(members)
                    mine = group if me in members else mine
            copies = [states[s][name] for s, name in zip(tied.stages, tied.names) if s in states]
            elsewhere.update(id(states[s][name]) for s, name in zip(tied.stages, tied.names)
                             if s in states and s != min(tied.stages))
            if copies:
                self.tied.append((copies, mine))
        self.copies_counted_elsewhere = frozenset(elsewhere)

    @torch.no_grad()
    def sum_gradients(self) -> None:
        for copies, group in self.tied:
            for copy in copies:
                if copy.grad is None:  # its stage did not use the copy this step: its share of the sum is zero
                    copy.grad = torch.zeros_like(copy)
            grads = [_local(p.grad) for p in copies]
            total = grads[0].clone() if len(grads) > 1 else grads[0]
            for grad in grads[1:]:
                total += grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                if grad is not total:
                    grad.copy_(total)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: the CUDA allocator's, or the peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024  # Linux reports KiB


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor(float(value), device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()
