"""Process group, device mesh, data parallelism (DDP / FSDP2), activation checkpointing, tied weights.

The mesh has dims ("pp", "dp_replicate", "dp_shard"), pipeline outermost as in torchtitan: with
ranks numbered node by node, the pipeline (point-to-point, little traffic) is the dimension that
crosses nodes and the data-parallel collectives stay inside a node where they can.
"""

from __future__ import annotations

import os
import resource
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.errors import UserError
from autoplan.runtime.split import PipelineSplit

MESH_DIMS = ("pp", "dp_replicate", "dp_shard")
ROOT_UNIT = ""
"""The unit name of the root module (a model whose root runs every op itself is one unit)."""


@dataclass(frozen=True)
class RankLayout:
    """Where this process sits in the mesh."""

    rank: int
    """Global rank (rank 0 prints and writes the results)."""
    pp_rank: int
    """Pipeline stage this rank runs."""
    dp_rank: int
    """Index among the data-parallel ranks of its stage (which slice of the batch it trains on)."""
    dp_size: int
    """Data-parallel ranks per stage (replicate x shard)."""
    pp_size: int
    """Pipeline stages."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_mesh(device: torch.device, pp: int, dp_replicate: int, dp_shard: int) -> tuple[DeviceMesh, RankLayout]:
    """Start the process group (NCCL on CUDA, gloo on CPU) and build the device mesh."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    world, planned = dist.get_world_size(), pp * dp_replicate * dp_shard
    if world != planned:
        raise UserError(f"this program was planned for pp {pp} x dp_replicate {dp_replicate} x dp_shard {dp_shard} "
                        f"= {planned} processes but runs on {world}: launch it with --nproc-per-node {planned} (per node)")
    mesh = init_device_mesh(device.type, (pp, dp_replicate, dp_shard), mesh_dim_names=MESH_DIMS)
    pp_rank, replicate_rank, shard_rank = mesh.get_coordinate()
    layout = RankLayout(rank=dist.get_rank(), pp_rank=pp_rank, dp_rank=replicate_rank * dp_shard + shard_rank,
                        dp_size=dp_replicate * dp_shard, pp_size=pp)
    return mesh, layout


def checkpoint_units(module: nn.Module, units: Sequence[str]) -> nn.Module:
    """Recompute each unit's activations during backward instead of keeping them (activation
    checkpointing, "full" recompute). Returns the module, wrapped itself if it is a unit ("")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for path in units:
        if path == ROOT_UNIT:
            return checkpoint_wrapper(module)
        parent_path, _, leaf = path.rpartition(".")
        setattr(submodule(module, parent_path), leaf, checkpoint_wrapper(submodule(module, path)))
    return module


def submodule(module: nn.Module, path: str) -> nn.Module:
    """module.get_submodule(path), with a UserError naming the plan's module if it is missing."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        raise UserError(f"the plan names module {path!r}, which the model does not have") from None


def data_parallel(module: nn.Module, mesh: DeviceMesh, zero_stage: int, units: Sequence[str],
                  device: torch.device) -> nn.Module:
    """DDP over the data-parallel ranks (zero 0), else FSDP2: fully_shard each unit, then the root.
    zero 3 reshards parameters after forward; zero 1/2 keep them gathered until backward (FSDP2
    has no separate ZeRO-1/2, this is the closest). Replicate x shard > 1 each gives HSDP."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicate * shard == 1:
        return module
    if zero_stage == 0:
        if shard > 1:
            raise UserError(f"zero_stage 0 (DDP) cannot shard: data_parallel_shard_degree is {shard}, expected 1")
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=mesh["dp_replicate"].get_group(),
                                       device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
    reshard = zero_stage == 3
    for path in _units_without_shared_parameters(module, units):
        fully_shard(submodule(module, path), mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)
    return module


def _units_without_shared_parameters(module: nn.Module, units: Sequence[str]) -> list[str]:
    """Units that own all their parameters. A parameter shared by two units (tied weights) must be
    managed by their common parent (FSDP2's rule), here the root."""
    units = [u for u in units if u != ROOT_UNIT]  # the root is sharded last in any case
    owners: dict[int, set[str]] = {}
    for path in units:
        for param in submodule(module, path).parameters():
            owners.setdefault(id(param), set()).add(path)
    shared = {u for paths in owners.values() if len(paths) > 1 for u in paths}
    return [u for u in units if u not in shared and any(True for _ in submodule(module, u).parameters())]


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


class TiedGradients:
    """Sums the gradients of a weight's copies on several stages (Megatron's embedding group), so
    the optimizer keeps the copies identical. Build it on every rank, before wrapping the stage."""

    def __init__(self, split: PipelineSplit, mesh: DeviceMesh, stage_module: nn.Module, pp_rank: int) -> None:
        self.copies: list[tuple[nn.Module, str, dist.ProcessGroup]] = []
        ranks = mesh.mesh  # (pp, dp_replicate, dp_shard) -> global rank
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        me = dist.get_rank()
        for tied in split.tied:
            mine = None
            for replica in range(ranks.shape[1]):
                for shard in range(ranks.shape[2]):
                    members = tuple(int(ranks[stage, replica, shard]) for stage in tied.stages)
                    if members not in groups:  # every rank creates every group, in the same order
                        groups[members] = dist.new_group(list(members))
                    if me in members:
                        mine = groups[members]
            if pp_rank in tied.stages:
                owner_path, _, attr = tied.names[tied.stages.index(pp_rank)].rpartition(".")
                self.copies.append((stage_module.get_submodule(owner_path), attr, mine))

    @torch.no_grad()
    def sum_gradients(self) -> None:
        for owner, attr, group in self.copies:
            grad = getattr(owner, attr).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: this rank's shard
            dist.all_reduce(local, group=group)


def global_mean_loss(local_loss: torch.Tensor | None, layout: RankLayout, device: torch.device) -> float:
    """The global-batch mean loss: the last stage's ranks hold their data-parallel slice's mean."""
    total = torch.zeros((), device=device) if local_loss is None else local_loss.detach().reshape(()).to(device)
    dist.all_reduce(total)
    return total.item() / layout.dp_size


def peak_memory_bytes(device: torch.device) -> int:
    """The largest peak over ranks: CUDA allocator peak, or peak resident set size on CPU."""
    if device.type == "cuda":
        local = torch.cuda.max_memory_allocated(device)
    else:
        kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        local = kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024  # Linux reports KiB
    peak = torch.tensor(float(local), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())
