"""Process group and the device mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp").

Dims in rank order, pipeline outermost and tensor parallel innermost as in torchtitan: with ranks
numbered node by node, the tensor-parallel group (an all-reduce per layer) stays on the fastest
links, the context-parallel ring (attention's keys and values, every layer) next, the data-parallel
collectives next, and the pipeline (point-to-point, little traffic) is the dimension that crosses nodes.
The ranks of a context-parallel group train the same samples, each on its share of every sequence; FSDP2
shards the model states over dp_shard x cp (the flattened dim "dp_shard_cp", torchtitan's name).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.errors import UserError
from autoplan.layout import Parallelism, stage_rank

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FSDP_DIM = "dp_shard_cp"
"""The flattened ("dp_shard", "cp") dim FSDP2 shards over (with "dp_replicate" for HSDP)."""


@dataclass(frozen=True)
class RankLayout:
    """Where this process sits in the mesh."""

    rank: int
    """Global rank (rank 0 prints and writes the results)."""
    pp_rank: int
    """Pipeline rank: it runs Parallelism.rank_stages(pp_rank) (one per virtual stage)."""
    dp_rank: int
    """Index among the data-parallel ranks (which slice of the global batch it trains on; the ranks of a
    context-parallel group share it)."""
    dp: int
    """Data-parallel ranks (replicate x shard)."""
    pp: int
    """Pipeline ranks."""
    tp_rank: int = 0
    """Index in the tensor-parallel group (all of its ranks see the same batch)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    cp_rank: int = 0
    """Index in the context-parallel group (which share of each sequence its blocks compute)."""
    cp: int = 1
    """Context-parallel ranks (they train the same samples)."""
    placement: str = "loop"
    """The schedule's stage placement (autoplan.layout.Schedule.placement): with "v" pipeline rank 0 runs the
    first stage and the last."""
    virtual_stages: int = 1
    """Stages per pipeline rank."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == stage_rank(self.pp * self.virtual_stages - 1, self.pp, self.placement)


@dataclass(frozen=True)
class RankSetup:
    """The plan's layout as this process runs it: what a pipeline step reads besides its stages."""

    parallelism: Parallelism
    """The layout (schedule, micro-batches, tp, loss_parallel, ...)."""
    mesh: DeviceMesh
    """The device mesh, dims MESH_DIMS."""
    rank: RankLayout
    """Where this process sits in it."""
    device: torch.device
    """Where it computes."""
    dtype: torch.dtype
    """The compute dtype (parallel.compute_dtype)."""


PROCESS_GROUP_TIMEOUT_S = 1800.0
"""How long a collective waits for every rank before the process group gives up, seconds, unless the program
says otherwise (train.py sizes it to the model: codegen/program.py process_group_timeout_s). torch's default,
10 minutes under NCCL, is shorter than rank 0 takes to build a large model on the CPU while the other ranks
wait in the first broadcast."""


def local_device(device: torch.device | str) -> torch.device:
    """`device` with this process's GPU index: "cuda" alone is cuda:LOCAL_RANK (torchrun's local rank; the GPU
    device_mesh makes current), which DDP's device_ids and every per-GPU call need; other devices as they are."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def mesh_shape(parallelism: Parallelism) -> tuple[int, int, int, int, int]:
    """The sizes of the mesh's MESH_DIMS for `parallelism`: (pp, dp_replicate, dp_shard, cp, tp)."""
    p = parallelism
    return p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp


def device_mesh(device: torch.device, parallelism: Parallelism, timeout_s: float | None = None) -> DeviceMesh:
    """The mesh MESH_DIMS of `parallelism` over all processes, after starting the process group (NCCL on CUDA, gloo
    on CPU; collectives time out after `timeout_s`, default PROCESS_GROUP_TIMEOUT_S) unless one is running. A
    UserError if the world size is not the layout's."""
    if device.type == "cuda":
        torch.cuda.set_device(local_device(device))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S if timeout_s is None else timeout_s)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    world, planned = dist.get_world_size(), parallelism.world_size
    if world != planned:
        raise UserError(f"the plan is for {parallelism.world_size_arithmetic()} but {world} are running: launch it "
                        f"with {planned} processes (torchrun --nproc-per-node {planned} on one machine)")
    return init_device_mesh(device.type, mesh_shape(parallelism), mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: "dp_shard", or with cp > 1 FSDP_DIM (dp_shard x cp flattened, so gradients
    are averaged over the context-parallel ranks too), with "dp_replicate" before it when it is more than 1
    (HSDP). The first call with cp > 1 flattens (a collective: every rank calls it; later calls find it)."""
    shard = "dp_shard"
    if mesh["cp"].size() > 1:
        mesh["dp_shard", "cp"]._flatten(FSDP_DIM)
        shard = FSDP_DIM
    return mesh["dp_replicate", shard] if mesh["dp_replicate"].size() > 1 else mesh[shard]


def rank_layout(mesh: DeviceMesh, parallelism: Parallelism) -> RankLayout:
    """Where this process sits in the (pp, dp_replicate, dp_shard, cp, tp) mesh of `parallelism` (whose schedule
    places the stages on the pipeline ranks)."""
    pp, dp_replicate, dp_shard, cp, tp = mesh.shape
    pp_rank, replicate_rank, shard_rank, cp_rank, tp_rank = mesh.get_coordinate()
    return RankLayout(rank=dist.get_rank(), pp_rank=pp_rank, dp_rank=replicate_rank * dp_shard + shard_rank,
                      dp=dp_replicate * dp_shard, pp=pp, tp_rank=tp_rank, tp=tp, cp_rank=cp_rank,
                      cp=cp, placement=parallelism.placement,
                      virtual_stages=parallelism.virtual_stages)


def global_mean_loss(local_loss: torch.Tensor | None, layout: RankLayout, device: torch.device) -> float:
    """The global-batch mean loss. The last stage's ranks hold their data-parallel slice's mean (with
    context parallelism, the mean over their equal share of its tokens: the cp ranks' mean is the slice's);
    the ranks of a tensor-parallel group hold the same value, so only tp rank 0 contributes."""
    counts = local_loss is not None and layout.tp_rank == 0
    total = local_loss.detach().reshape(()).float().to(device) if counts else torch.zeros((), device=device)
    dist.all_reduce(total)
    return total.item() / (layout.dp * layout.cp)
