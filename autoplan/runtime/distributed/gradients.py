"""Every parameter's gradient as a full tensor under the model's own name, for autoplan verify's gradient check.

The loss parity alone cannot see a gradient summed or averaged with the wrong factor: AdamW's update is
(nearly) invariant to a parameter's gradient scale, so a layout that halves every expert gradient trains to
the same losses. Under autoplan verify, train.py (its hook, runtime/harness/hooks.py) therefore writes, after the first
step's forward and backward (before the optimizer step), the gradient of the global batch's mean loss of each parameter it holds (clipped) to
DIR/rank<R>.pt (the reference: DIR/rank0.pt), and autoplan.verify compares every rank's file with the
reference's, parameter by parameter. They are written after clipping (clip_grad_norm_): verify runs both sides
with a clipping norm below any gradient norm (verify.VERIFY_CLIP_GRAD_NORM), so every gradient is scaled by the
global norm each layout computes, and a norm computed wrongly on some layout shows as every gradient off.

How a rank's gradients become the model's full tensors:
  names      a pipeline stage's names map to the model's by PipelineSplit.state_fqns; the names wrappers add
             (activation checkpointing's _checkpoint_wrapped_module., torch.compile's _orig_mod., DDP's
             module.) are dropped first (parallel.named_state / canonical_name), as materialize does;
  DTensors   FSDP2, HSDP, tensor-parallel and the experts' (on their expert meshes) gradients are gathered with
             full_tensor(), a collective over the DTensor's mesh: every rank walks its stages and parameters in
             the same order, and the ranks of one pipeline stage hold the same parameter list, so the ranks of
             each mesh call it alike;
  the rest   DDP's and undivided parameters' gradients are full already; a weight tied across pipeline stages
             holds the summed gradient on each stage (TiedGradients ran in forward_backward); CPU offload's
             gradients are on the host already.
A parameter without a gradient (.grad None: unused in the step) is recorded as zeros, on both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.runtime.distributed.names import canonical_name

GRADIENTS_FILE = "rank{rank}.pt"
"""The file each process writes in the gradients folder."""


def parameter_aliases(model: nn.Module) -> list[list[str]]:
    """The names of each distinct parameter of the single-device model with more than one (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def reference_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The single-device model's gradients by every name of each parameter (tied weights under each)."""
    return {name: _full_or_zeros(param) for name, param in model.named_parameters(remove_duplicate=False)}


def full_gradients(parts: dict[int, nn.Module], state_fqns: list[dict[str, str]] | None) -> dict[str, torch.Tensor]:
    """This rank's parameters' gradients as full CPU tensors by the model's FQN. `parts`: Parallelized.parts;
    `state_fqns`: Parallelized.split.state_fqns (None without a pipeline). A collective for DTensor
    gradients: call it on every rank."""
    found: dict[str, torch.Tensor] = {}
    for stage, module in sorted(parts.items()):
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module = module.module
        fqns = state_fqns[stage] if state_fqns is not None else None
        for name, param in module.named_parameters():
            name = canonical_name(name)
            fqn = name if fqns is None else fqns.get(name)
            if fqn is None:
                raise ValueError(f"pipeline stage {stage}'s parameter {name!r} has no name in the model "
                                 f"(PipelineSplit.state_fqns[{stage}] lacks it)")
            found[fqn] = _full_or_zeros(param)
    return found


def save_gradients(directory: Path, parallel: Any) -> Path:
    """Write this rank's gradients (full_gradients of an autoplan.Parallelized) to directory/rank<R>.pt,
    R its global rank. A collective: call it on every rank, after forward_backward."""
    split = parallel.split
    gradients = full_gradients(parallel.parts, split.state_fqns if split is not None else None)
    return _write(directory, dist.get_rank(), gradients, [])


def save_reference_gradients(directory: Path, model: nn.Module) -> Path:
    """Write the single-device model's gradients (every name of each parameter) and its tied parameters'
    names to directory/rank0.pt."""
    return _write(directory, 0, reference_gradients(model), parameter_aliases(model))


def _write(directory: Path, rank: int, gradients: dict[str, torch.Tensor], aliases: list[list[str]]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / GRADIENTS_FILE.format(rank=rank)
    torch.save({"gradients": gradients, "aliases": aliases}, path)
    return path


def _full_or_zeros(param: torch.Tensor) -> torch.Tensor:
    """The parameter's whole gradient on the CPU in fp32 (zeros without one)."""
    grad = param.grad
    if grad is None:
        return torch.zeros(param.shape, dtype=torch.float32)
    if hasattr(grad, "full_tensor"):
        grad = grad.full_tensor()
    return grad.detach().to(device="cpu", dtype=torch.float32).clone()


@torch.no_grad()
def clip_grad_norm_(parameters: Any, max_norm: float, pp_group: dist.ProcessGroup | None = None,
                    counted_elsewhere: frozenset[int] = frozenset()) -> float:
    """Scale the gradients of `parameters` so that the global gradient norm (the L2 norm of every gradient of the
    whole model, as one device computes it with torch.nn.utils.clip_grad_norm_) is at most `max_norm`; returns that
    norm before clipping. `max_norm` 0: measure only.

    Each rank holds part of the model. A DTensor gradient (FSDP2's shards, tensor-parallel and expert-parallel
    weights) adds its local shard's squares, summed over the mesh dims it is sharded on (one all-reduce per mesh,
    placement and dim: the ranks of a mesh hold the same parameter lists in the same order; on the mesh's device,
    so CPU-offloaded shards on a GPU mesh sum too); on a dim it is replicated on, every rank holds the same values.
    Plain gradients are whole and the same on every rank holding them (DDP's are averaged already). A pipeline rank
    holds its stages only: the squares are summed over `pp_group`. A weight tied across pipeline stages holds the
    summed gradient on each of its stages: the copies whose id is in `counted_elsewhere` are left out of the norm
    (and scaled like the rest)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dim under tensor parallelism

    from autoplan.runtime.distributed.parallel import _local

    held = [p for p in parameters if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in held:  # one sum per mesh and placement (DTensors), one for the plain gradients
        if id(p) in counted_elsewhere:
            continue
        grad = p.grad
        key = (id(grad.device_mesh), tuple(grad.placements)) if isinstance(grad, DTensor) else ("plain",)
        groups.setdefault(key, []).append(grad)
    squares = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        local = sum(float(torch.linalg.vector_norm(_local(g), dtype=torch.float32)) ** 2 for g in grads)
        first = grads[0]
        if isinstance(first, DTensor):
            mesh = first.device_mesh
            summed = torch.tensor(local, dtype=torch.float64, device=mesh.device_type)
            for dim, placement in enumerate(first.placements):
                if isinstance(placement, (Shard, _StridedShard)):
                    dist.all_reduce(summed, group=mesh.get_group(dim))
                elif not isinstance(placement, Replicate):
                    raise ValueError(f"a gradient still {placement} on its mesh's dim {dim}: reduce it before "
                                     f"clipping")
            local = float(summed)
        squares += local
    if pp_group is not None:  # each pipeline rank holds its own stages
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" else "cpu"
        summed = squares.to(device)
        dist.all_reduce(summed, group=pp_group)
        squares = summed.cpu()
    total = float(squares.sqrt())
    coefficient = max_norm / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s
    if max_norm > 0 and coefficient < 1.0:
        for p in held:
            p.grad.mul_(coefficient)
    return total

