"""Sequence parallelism's all-gather before the column-parallel Linears, as Megatron-LM runs it.

Between the tensor-parallel pairs the activations are sequence shards (Shard(1) DTensors), and a
column-parallel Linear needs the whole sequence: its input is all-gathered. torch's ColwiseParallel
(input_layouts=Shard(1)) gathers in each Linear's own input hook, and autograd then keeps the gathered
tensor for the weight gradient: 2 s b h bytes per Linear whatever tp is. SequenceGather, hooked before it:
- gathers once for the Linears that read the same tensor (q, k and v; an MLP's gate and up): they get one
  gathered tensor, held until a different input is gathered, a row-parallel Linear runs or the forward ends;
- keeps the shard for backward in place of the gathered tensor and gathers it again there, once per input
  (Korthikanti et al. 2022, Sec. 4.2.2: Eq. 4 counts these inputs at 2 s b h / tp). A saved_tensors_hooks
  pair around each such Linear's forward replaces what autograd saves that lives in the gathered storage
  (the input or a view of it) by its place in the re-gathered one.

Inside a compiled module (torch.compile traces these hooks as no-ops) ColwiseParallel gathers per Linear and
the compiled graph keeps what it gathered. Inside activation checkpointing (another saved-tensors hook already active) the checkpoint decides what is
kept: the shard is not swapped in. A shard written in place between forward and backward stops backward
with a clear error (its version counter moved), as autograd does for any saved tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard


def _sequence_sharded(t: Any) -> bool:
    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(1),)


def _outer_saved_tensors_hooks() -> bool:
    """True when a saved-tensors hook is active already (activation checkpointing's)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class SavedShard:
    """A sequence shard standing in for the tensor gathered from it in what autograd keeps for backward."""

    def __init__(self, shard: DTensor, gathered: DTensor) -> None:
        self.shard = shard.detach()
        self.version = shard._version
        local = gathered._local_tensor
        self.storage = local.untyped_storage().data_ptr()
        self.offset = local.storage_offset()
        self.usable = local.is_contiguous()
        self.pending = 0
        self.full: torch.Tensor | None = None
        """The re-gathered local tensor while saved views of it wait to be unpacked in backward."""

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not self.usable or local.untyped_storage().data_ptr() != self.storage:
            return t
        self.pending += 1
        return GatheredView(self, t, local)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor() if isinstance(packed, GatheredView) else packed

    def regathered(self) -> torch.Tensor:
        if self.shard._version != self.version:
            raise RuntimeError("sequence parallel: a sequence-sharded input of a column-parallel Linear was "
                               "modified in place after its forward; backward cannot gather it again")
        if self.full is None:
            with torch.no_grad():
                self.full = self.shard.redistribute(placements=[Replicate()]).to_local().contiguous()
        full = self.full
        self.pending -= 1
        if self.pending <= 0:  # the last saved view of it: free the gathered copy after this use
            self.full = None
        return full


class GatheredView:
    """What autograd keeps for one saved tensor in the gathered storage: its geometry and the shard."""

    def __init__(self, source: SavedShard, t: torch.Tensor, local: torch.Tensor) -> None:
        self.source = source
        self.size, self.stride = tuple(local.size()), tuple(local.stride())
        self.offset = local.storage_offset() - source.offset
        self.dtensor = (t.device_mesh, tuple(t.placements), t.shape, t.stride()) if isinstance(t, DTensor) else None

    def tensor(self) -> torch.Tensor:
        local = self.source.regathered().as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class SequenceGather:
    """The shared all-gather of one model part's column-parallel Linears (see the module docstring)."""

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, DTensor, SavedShard] | None = None
        self._open: dict[int, Any] = {}

    def attach(self, layer: nn.Module) -> None:
        """Hook a column-parallel Linear (before parallelize_module adds ColwiseParallel's own hooks)."""
        layer.register_forward_pre_hook(self._before)
        layer.register_forward_hook(self._after, always_call=True)

    def attach_release(self, module: nn.Module) -> None:
        """Drop the held gathered tensor when `module` (a row-parallel Linear, the part itself) runs."""
        module.register_forward_pre_hook(lambda *_: self.release())
        module.register_forward_hook(lambda *_: self.release(), always_call=True)

    def release(self) -> None:
        if not torch.compiler.is_compiling():
            self._last = None

    def _shared(self, x: DTensor) -> tuple[DTensor, SavedShard]:
        if self._last is not None and self._last[0]() is x:
            return self._last[1], self._last[2]
        gathered = x.redistribute(placements=[Replicate()])
        saved = SavedShard(x, gathered)
        self._last = (weakref.ref(x), gathered, saved)
        return gathered, saved

    def _before(self, module: nn.Module, args: tuple) -> tuple | None:
        if torch.compiler.is_compiling() or not args or not _sequence_sharded(args[0]):
            return None
        gathered, saved = self._shared(args[0])
        if torch.is_grad_enabled() and not _outer_saved_tensors_hooks():
            hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
            hooks.__enter__()
            self._open[id(module)] = hooks
        return (gathered, *args[1:])

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        hooks = self._open.pop(id(module), None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
