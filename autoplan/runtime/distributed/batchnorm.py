"""BatchNorm over the data-parallel batch: each rank normalizes with the statistics of every rank's
samples, so a data-parallel step trains like the single-device model on the whole global batch (running
statistics included).

On CUDA this is torch's nn.SyncBatchNorm. torch's refuses CPU tensors ("SyncBatchNorm expected input
tensor to be on GPU"), so on CPU (gloo) DataParallelBatchNorm does the same math: all-reduce the
per-channel sum, sum of squares and sample count over the data-parallel group, normalize with the global
mean and (biased) variance, and update the running statistics with the unbiased one. The all-reduce is
torch.distributed._functional_collectives' autograd-aware one, whose backward all-reduces the gradients
of those sums: the two per-channel gradient terms of torch's SyncBatchNorm backward
(torch/nn/modules/_functions.py).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import _functional_collectives as funcol
from torch.nn.modules.batchnorm import _BatchNorm

from autoplan.errors import UserError
from autoplan.runtime.distributed.names import canonical_name


def synchronized_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                            running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                            momentum: float, eps: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Training-mode batch norm of `x` (N, C, ...) with per-channel statistics over every rank of
    `group`; updates the running statistics (when given) in place with `momentum`. Statistics in fp32."""
    channels, dims = x.shape[1], [0, *range(2, x.dim())]
    shape = [1, channels] + [1] * (x.dim() - 2)
    values = x.float()
    count = torch.full((1,), float(x.numel() // channels), device=x.device)
    local = torch.cat([values.sum(dims), (values * values).sum(dims), count])
    totals = funcol.wait_tensor(funcol.all_reduce(local, "sum", group))
    samples = totals[-1]
    mean = totals[:channels] / samples
    var = totals[channels:2 * channels] / samples - mean * mean
    if running_mean is not None and running_var is not None:
        _update_running(running_mean, running_var, mean.detach(), var.detach(), samples.item(), momentum)
    out = (values - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape) + bias.view(shape)
    return out.to(x.dtype)


@torch.no_grad()
def _update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                    samples: float, momentum: float) -> None:
    """Exponential moving averages as nn.BatchNorm keeps them: the variance unbiased (n / (n - 1))."""
    unbiased = var * (samples / max(samples - 1, 1.0))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


class DataParallelBatchNorm(_BatchNorm):
    """nn.BatchNorm*d whose training statistics span the data-parallel group (any device; what
    nn.SyncBatchNorm does on CUDA). Same parameter and buffer names as the module it replaces."""

    def __init__(self, num_features: int, eps: float, momentum: float | None, affine: bool,
                 track_running_stats: bool, group: dist.ProcessGroup | None, device=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"runtime.batchnorm: expected an input of 2 or more dimensions (N, C, ...), got "
                             f"{input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        momentum = self.momentum if self.momentum is not None else 0.0
        tracked = self.track_running_stats and self.running_mean is not None
        if tracked and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        return synchronized_batch_norm(input, self.weight, self.bias, self.running_mean if tracked else None,
                                       self.running_var if tracked else None, momentum, self.eps, self.group)


def sync_batch_norm(module: nn.Module, mesh: DeviceMesh, names: Sequence[str]) -> nn.Module:
    """Replace the BatchNorm modules `names` (the plan's batch_norm_modules) of `module` by ones synchronized
    over the data-parallel ranks: nn.SyncBatchNorm on CUDA, DataParallelBatchNorm elsewhere. Names are
    canonical (found through checkpoint and other wrappers). The same parameters and buffers move over (a
    meta-device module stays on meta). No-op without data parallelism."""
    if not names or mesh["dp_replicate"].size() * mesh["dp_shard"].size() == 1:
        return module
    group = data_parallel_group(mesh)
    paths = {canonical_name(path): path for path, _ in module.named_modules()}
    for name in names:
        if name not in paths:
            raise UserError(f"runtime.batchnorm: the plan names BatchNorm module {name!r}, which the model does not "
                            f"have: re-run autoplan on this model")
        old = module.get_submodule(paths[name])
        if not isinstance(old, _BatchNorm):
            raise UserError(f"runtime.batchnorm: the plan names {name!r} as a BatchNorm module, but the model's "
                            f"{name!r} is a {type(old).__name__}: re-run autoplan on this model")
        new = nn.SyncBatchNorm.convert_sync_batchnorm(old, group) if mesh.device_type == "cuda" \
            else _data_parallel_copy(old, group)
        parent, _, child = paths[name].rpartition(".")
        setattr(module.get_submodule(parent), child, new)
    return module


def _data_parallel_copy(old: _BatchNorm, group: dist.ProcessGroup) -> DataParallelBatchNorm:
    """A DataParallelBatchNorm holding `old`'s parameters and buffers themselves (not copies)."""
    new = DataParallelBatchNorm(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats,
                                group, device="meta")
    if old.affine:
        new.weight, new.bias = old.weight, old.bias
    new.running_mean, new.running_var = old.running_mean, old.running_var
    new.num_batches_tracked = old.num_batches_tracked
    new.train(old.training)
    return new


def data_parallel_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of this rank's data-parallel ranks (dp_replicate x dp_shard, same pp, cp and tp
    coordinates). With both dimensions > 1 every rank creates every such group, in the same order."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if shard == 1:
        return mesh["dp_replicate"].get_group()
    if replicate == 1:
        return mesh["dp_shard"].get_group()
    ranks, mine = mesh.mesh, None  # (pp, dp_replicate, dp_shard, cp, tp) -> global rank
    for p in range(ranks.shape[0]):
        for c, t in itertools.product(range(ranks.shape[3]), range(ranks.shape[4])):
            members = [int(r) for r in ranks[p, :, :, c, t].flatten()]
            group = dist.new_group(members)
            mine = group if dist.get_rank() in members else mine
    return mine
