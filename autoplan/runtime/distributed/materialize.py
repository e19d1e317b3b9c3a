"""Initial weights: build the model on the meta device, give each rank only its stage and shard,
then fill them with exactly the single-device model's values.

How the values get there (the trade-off): rank 0 builds the whole model once on CPU with the
plan's seed, as the single-device run does, and broadcasts it tensor by tensor; every rank copies
into its own stage/shard what it holds (DTensor shards are sliced locally). This is correct for any
model, whatever its __init__ does with the random generator, and no rank other than 0 ever holds
more than one full tensor at a time. The cost: rank 0 needs host memory for the whole model, and
the broadcast sends every tensor to every rank. The other way, replaying each module's own
initializer on its shard (torchtitan's init_weights), needs a per-model init function that draws
the same random numbers as the model's __init__, which an unmodified model does not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import UserError
from autoplan.runtime.distributed.parallel import named_state
from autoplan.contract import ModelSource, call_user


@dataclass(frozen=True)
class TensorEntry:
    """One distinct parameter or buffer of the model."""

    fqns: tuple[str, ...]
    """Every name it has in the model (several for tied weights)."""
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ModelPart:
    """A module this rank trains (the model, or a pipeline stage) and how its names map to the model's."""

    module: nn.Module
    model_fqns: dict[str, str] | None = None
    """Canonical name in `module` -> the model's FQN; None when the names are the model's own."""

    def model_fqn(self, name: str) -> str | None:
        return name if self.model_fqns is None else self.model_fqns.get(name)


def build_on_meta(source: ModelSource) -> nn.Module:
    """The model's structure without memory: build_model() under torch.device("meta")."""
    try:
        with torch.device("meta"):
            return call_user(source, "build_model()", source.build_model)
    except UserError as e:
        raise UserError(f"{e} (while building the model on the meta device, which the generated program "
                        "does to place only each rank's share of the weights in memory)") from None


def catalog(model: nn.Module) -> list[TensorEntry]:
    """Every distinct tensor of the model with all its names, in named_parameters/buffers order."""
    entries: dict[int, TensorEntry] = {}
    for fqn, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        entry = entries.get(id(tensor))
        if entry is None:
            entries[id(tensor)] = TensorEntry((fqn,), tuple(tensor.shape), tensor.dtype)
        else:
            entries[id(tensor)] = TensorEntry((*entry.fqns, fqn), entry.shape, entry.dtype)
    return list(entries.values())


def materialize(parts: Sequence[ModelPart], entries: Sequence[TensorEntry], source: ModelSource, seed: int,
                device: torch.device, offload: bool = False) -> None:
    """Allocate the parts on `device` and fill them with the values build_model() gives after
    torch.manual_seed(seed) (rank 0 builds it, every rank receives it). `offload` (FSDP2 CPU offload):
    parameters are allocated in host memory, buffers on `device` (torchtitan's init_device and buffer_device)."""
    materialize_from(parts, entries, lambda: named_tensors(build_seeded(source, seed)), device, offload)


def build_seeded(source: ModelSource, seed: int) -> nn.Module:
    """The single-device model: build_model() after torch.manual_seed(seed), as the reference run builds it."""
    torch.manual_seed(seed)
    return call_user(source, "build_model()", source.build_model)


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name of every parameter and buffer -> its values (tied tensors under each of their names)."""
    return {fqn: t.detach() for fqn, t in [*module.named_parameters(remove_duplicate=False),
                                           *module.named_buffers(remove_duplicate=False)]}


def materialize_from(parts: Sequence[ModelPart], entries: Sequence[TensorEntry],
                     initial_values: Callable[[], Mapping[str, torch.Tensor]], device: torch.device,
                     offload: bool = False) -> None:
    """Allocate the parts on `device` and fill them with rank 0's `initial_values()` (called on rank 0
    only: model FQN -> full tensor, every name in `entries` present), broadcast tensor by tensor.
    `offload` (FSDP2 CPU offload): parameters in host memory, buffers on `device`."""
    for part in parts:
        _to_empty_keeping_ties(part.module, torch.device("cpu") if offload else device)
        if offload:
            moved: dict[int, torch.Tensor] = {}  # a buffer shared by several modules stays shared
            for module in part.module.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = moved.setdefault(id(buffer), buffer.to(device))
    targets: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for name, tensor in named_state(part.module).items():
            fqn = part.model_fqn(name)
            if fqn is not None:
                targets.setdefault(fqn, []).append(tensor)
    values: Mapping[str, torch.Tensor] = {}
    problem = [None]
    if dist.get_rank() == 0:
        values = initial_values()
        problem = [_mismatch(values, entries)]
    dist.broadcast_object_list(problem, src=0)  # every rank stops with rank 0's message, none waits
    if problem[0]:
        raise UserError(problem[0])
    with torch.no_grad():
        for entry in entries:
            if dist.get_rank() == 0:
                value = values[entry.fqns[0]].detach().to(device=device, dtype=entry.dtype)
            else:
                value = torch.empty(entry.shape, dtype=entry.dtype, device=device)
            dist.broadcast(value, src=0)
            seen = set()
            for fqn in entry.fqns:
                for target in targets.get(fqn, []):
                    if id(target) not in seen:
                        seen.add(id(target))
                        _copy_into(target, value)


def _mismatch(values: Mapping[str, torch.Tensor], entries: Sequence[TensorEntry]) -> str | None:
    """Why `values` cannot initialize the tensors `entries`, or None."""
    missing = [e.fqns[0] for e in entries if e.fqns[0] not in values]
    if missing:
        return (f"the initial values lack {len(missing)} of the model's {len(entries)} tensors (e.g. "
                f"{missing[0]!r}): they must come from the same model")
    for entry in entries:
        shape = tuple(values[entry.fqns[0]].shape)
        if shape != entry.shape:
            return (f"the initial value of {entry.fqns[0]!r} has shape {shape}, the model's tensor {entry.shape}: "
                    "they must come from the same model")
    return None


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter or buffer, or into this rank's shard of a DTensor."""
    if hasattr(target, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """module.to_empty(device), keeping tensors shared by several submodules shared (to_empty
    alone gives each a copy) and the values of tensors that are not on meta (constants the
    export lifted into a stage)."""
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    kept: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for store, is_param in ((owner._parameters, True), (owner._buffers, False)):
            for name, tensor in store.items():
                if tensor is None:
                    continue
                slots.setdefault(id(tensor), []).append((owner, name, is_param))
                if not tensor.is_meta and not hasattr(tensor, "device_mesh"):
                    kept[id(tensor)] = tensor.detach().clone()
    module.to_empty(device=device)
    with torch.no_grad():
        for key, places in slots.items():
            owner, name, is_param = places[0]
            first = (owner._parameters if is_param else owner._buffers)[name]
            if key in kept:
                first.copy_(kept[key])
            for owner, name, is_param in places[1:]:
                (owner._parameters if is_param else owner._buffers)[name] = first
