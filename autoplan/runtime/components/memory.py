"""Peak bytes of live tensor storage during one training step, per process.

On CUDA the caching allocator already counts this (``max_memory_allocated``). On CPU nothing does:
the process RSS is dominated by ~400 MB of libraries and never goes down. So on CPU (and any other
device without allocator statistics) ``PeakLiveMemory`` counts tensor storages itself:

* at ``__enter__`` it walks every Python-visible tensor (``gc.get_objects()``), unwraps tensor
  subclasses (a DTensor counts its local shard, not its global shape) and records each distinct
  untyped storage once: that sum is ``baseline_bytes`` (parameters, gradients, optimizer state,
  buffers, the batch, anything alive);
* inside the block a ``TorchDispatchMode`` sees every aten op, forward, backward (the autograd engine
  carries the mode to its ops), optimizer and the local ops a DTensor desugars into. Each output
  storage not seen before is a new allocation; every recorded storage gets a weakref whose callback
  subtracts its bytes when the storage is freed (untyped storages keep one Python object per C++
  storage, so the callback fires when the memory goes, not when a Python name goes);
* ``UntypedStorage.resize_`` is wrapped while inside, because FSDP2 allocates and frees its unsharded
  parameters by resizing storages, which no dispatch mode sees.

What it cannot see (documented, not guessed at):

* scratch memory a single aten kernel allocates and frees internally (only op outputs are seen);
* tensors held only by C++ at ``__enter__`` (e.g. DDP's gradient buckets): no Python object points
  at them. They are counted from the first op that reads them on, not in the baseline (once seen, the
  storage keeps a Python object, so the next ``__enter__`` finds it). One no op touches stays uncounted;
* tensors created on other threads (gloo's worker threads make reduce-scatter temporaries) until an op
  on this thread uses them. That is why a storage first met as an op *input* counts from then on, not
  from ``__enter__``: counted from ``__enter__``, each layer's reduce-scatter temporary of FSDP2 over
  gloo would join the baseline, overstating the peak by a whole model's worth of gradients.

Storages are keyed by identity, so two views of one storage count once and two storages count twice
even if one was made from the other's memory with ``from_blob``.

``peak_parts`` says what the peak was made of (CPU only): the storages alive at the peak's moment are kept (weakly)
until ``__exit__``, which sorts them by what holds them then, found the same way as the baseline (every
Python-visible object): ``parameters`` (every ``nn.Parameter``, FSDP2's gathered copies included),
``gradients`` (their ``.grad``), ``optimizer`` (the tensors in every optimizer's state), ``buffers`` (modules'
buffers) and ``activations`` (the rest: saved activations, temporaries, communication buffers). A gradient is what
a parameter's ``.grad`` held at the peak's moment (looked up then, over the parameters alive at ``__enter__``): FSDP2's
unsharded gradients accumulated across micro-batches are the gathered parameter's ``.grad`` until the last
micro-batch's reduce-scatter drops them, so by ``__exit__`` nothing holds them.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


class PeakLiveMemory:
    """Peak bytes of live tensor storage on `device` while inside `with tracker:` (a step).

    ``baseline_bytes`` is what was alive at ``__enter__``; ``peak_bytes`` (valid after ``__exit__``) is
    the largest live total at any moment inside the block, baseline included. Re-entering starts over.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        """Device whose memory is counted."""
        self.baseline_bytes = 0
        """Live bytes at ``__enter__`` (Python-visible storages only)."""
        self.peak_bytes = 0
        """Largest live bytes inside the block, baseline included."""
        self.peak_parts: dict[str, int] = {}
        """What was alive at the peak, by what holds it at ``__exit__`` (PEAK_PARTS; CPU only, else empty)."""
        self._live: _LiveStorages | None = None

    def __enter__(self) -> PeakLiveMemory:
        if self._live is not None:
            raise RuntimeError("PeakLiveMemory is not re-entrant: exit the block before entering it again")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = self.peak_bytes = torch.cuda.memory_allocated(self.device)
            return self
        live = _LiveStorages(self.device)
        live.start()
        self._live = live
        self.baseline_bytes = self.peak_bytes = live.baseline_bytes
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        live, self._live = self._live, None
        if live is None:
            raise RuntimeError("PeakLiveMemory.__exit__ without a matching __enter__")
        self.peak_parts = live.peak_parts()
        live.stop()
        self.baseline_bytes = live.baseline_bytes
        self.peak_bytes = live.peak_bytes


@dataclass
class _Tracked:
    """One storage being counted."""

    nbytes: int
    """Its size the last time it was looked at."""
    ref: weakref.ref
    """Weak reference (never keeps the storage alive) whose callback uncounts the storage when it is freed."""


class _LiveStorages:
    """Running count of live storage bytes on one device, with its maximum."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline_bytes = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self._tracked: dict[int, _Tracked] = {}  # id(storage) -> record; the entry goes when the storage dies
        # Weakref callbacks may run on another thread (a gloo worker dropping the last reference) or in the
        # middle of an update on this one (a free triggered by gc): a re-entrant lock serves both.
        self._lock = threading.RLock()
        self._mode: _SeeOps | None = None
        self._resize: _WatchResize | None = None
        self._rising = False  # the live count has reached a new peak and not gone down since
        # (bytes, storage, a parameter's .grad then) of each storage alive at the peak
        self._at_peak: list[tuple[int, weakref.ref, bool]] = []
        self._parameters: list[weakref.ref] = []  # every nn.Parameter alive at start (FSDP2's unsharded ones too)

    def start(self) -> None:
        gc.collect()  # cyclic garbage is not live memory; without this it would land in the baseline
        for obj in gc.get_objects():
            kind = type(obj)  # not isinstance: that reads obj.__class__, which some module shims warn about
            if issubclass(kind, torch.Tensor):
                for storage in _storages(obj):
                    self.discover(storage)
                if isinstance(obj, torch.nn.Parameter):
                    self._parameters.append(weakref.ref(obj))
            elif issubclass(kind, torch.UntypedStorage):
                self.discover(obj)
        self._resize = _WatchResize(self)
        self._mode = _SeeOps(self)
        self._resize.__enter__()
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
        if self._resize is not None:
            self._resize.__exit__()
        self._mode = self._resize = None
        with self._lock:
            self._tracked.clear()  # drops the weakrefs, so their callbacks never fire after the block
            self._at_peak.clear()
            self._parameters.clear()

    def _on_device(self, storage: torch.UntypedStorage) -> bool:
        device = storage.device  # fake and meta tensors have meta storages: never counted
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def _register(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)

        def uncount(_: weakref.ref) -> None:
            with self._lock:
                self._leave_peak()
                tracked = self._tracked.pop(key, None)
                if tracked is not None:
                    self.live_bytes -= tracked.nbytes

        self._tracked[key] = _Tracked(nbytes, weakref.ref(storage, uncount))

    def discover(self, storage: torch.UntypedStorage) -> None:
        """A storage alive at ``__enter__``: part of the baseline."""
        if not self._on_device(storage):
            return
        with self._lock:
            if id(storage) in self._tracked:
                return
            nbytes = storage.nbytes()
            self._register(storage, nbytes)
            self.baseline_bytes += nbytes
            self.live_bytes += nbytes
            self._climb()

    def observe(self, storage: torch.UntypedStorage) -> None:
        """A storage an op read or returned: alive from now on if unseen, else maybe resized (``aten.resize_``)."""
        if not self._on_device(storage):
            return
        with self._lock:
            tracked = self._tracked.get(id(storage))
            nbytes = storage.nbytes()
            if tracked is None:
                self._register(storage, nbytes)
                self.live_bytes += nbytes
            elif tracked.nbytes != nbytes:
                if nbytes < tracked.nbytes:
                    self._leave_peak()
                self.live_bytes += nbytes - tracked.nbytes
                tracked.nbytes = nbytes
            self._climb()

    def _climb(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._rising = True

    def _leave_peak(self) -> None:
        """About to go down from a new peak: keep (weakly) what is alive now. The storage being freed is still
        tracked here; a weakref callback runs once its storage is dead, so its entry keeps the bytes only."""
        if not self._rising:
            return
        self._rising = False
        gradients = {id(storage) for ref in self._parameters
                     if (p := ref()) is not None and p.grad is not None for storage in _storages(p.grad)}
        self._at_peak = [(t.nbytes, t.ref, key in gradients) for key, t in self._tracked.items()]

    def peak_parts(self) -> dict[str, int]:
        """Bytes of the storages alive at the peak by what holds them now (PeakLiveMemory.peak_parts)."""
        with self._lock:
            self._leave_peak()  # the peak is the present moment
            at_peak = list(self._at_peak)
        holders = _holders(self.device)
        parts = dict.fromkeys(PEAK_PARTS, 0)
        for nbytes, ref, gradient in at_peak:
            storage = ref()
            part = holders.get(id(storage), "activations") if storage is not None else "activations"
            if part == "activations" and gradient:  # a gradient at the peak, freed or let go by now
                part = "gradients"
            parts[part] += nbytes
        return parts



PEAK_PARTS = ("parameters", "gradients", "optimizer", "buffers", "activations")
"""What PeakLiveMemory.peak_parts sorts the peak into; activations: whatever no parameter, gradient, optimizer
state or buffer holds (saved activations, temporaries, communication buffers)."""


def _holders(device: torch.device) -> dict[int, str]:
    """id(storage) -> the part holding it, for every Python-visible parameter, gradient, optimizer state tensor and
    module buffer (a storage held by two counts as the first of PEAK_PARTS)."""
    found: dict[str, list[torch.Tensor]] = {part: [] for part in PEAK_PARTS}
    for obj in gc.get_objects():
        kind = type(obj)
        # a Parameter of a tensor subclass (FSDP2's DTensor shards) has the subclass's type: isinstance sees it
        if issubclass(kind, torch.Tensor) and isinstance(obj, torch.nn.Parameter):
            found["parameters"].append(obj)
            if obj.grad is not None:
                found["gradients"].append(obj.grad)
        elif issubclass(kind, torch.optim.Optimizer):
            found["optimizer"].extend(t for state in obj.state.values() for t in _tensors(state))
        elif issubclass(kind, torch.nn.Module):
            found["buffers"].extend(b for b in obj._buffers.values() if b is not None)
    holders: dict[int, str] = {}
    for part in reversed(PEAK_PARTS[:-1]):  # the first part wins
        for tensor in found[part]:
            for storage in _storages(tensor):
                if storage.device.type == device.type:
                    holders[id(storage)] = part
    return holders


class _SeeOps(TorchDispatchMode):
    """Reports every op's inputs (storages alive but not seen yet) and outputs (new storages) to the count."""

    def __init__(self, live: _LiveStorages) -> None:
        super().__init__()
        self.live = live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Give wrapper subclasses (DTensor, AsyncCollectiveTensor) the op first: they turn it into ops on
        # their local tensors, which come back here. Run here instead, the op would execute with this mode
        # popped, hiding the temporaries of a redistribution (only the unwrapped result would be seen).
        # FakeTensor (DTensor's sharding propagation) is no wrapper: it runs here and its meta storage is skipped.
        if any(hasattr(kind, "__tensor_flatten__") for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        for tensor in _tensors((args, kwargs)):
            for storage in _storages(tensor):
                self.live.observe(storage)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            for storage in _storages(tensor):
                self.live.observe(storage)
        return out


class _WatchResize:
    """Wraps ``UntypedStorage.resize_`` (invisible to dispatch modes, used by FSDP2) while inside."""

    _ABSENT = object()

    def __init__(self, live: _LiveStorages) -> None:
        self.live = live
        self._own_attribute: Any = self._ABSENT

    def __enter__(self) -> None:
        self._own_attribute = torch.UntypedStorage.__dict__.get("resize_", self._ABSENT)
        resize = torch.UntypedStorage.resize_  # whatever is in force now, so nested watchers chain
        live = self.live

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            live.observe(storage)  # at its old size, if this is the first time it is seen
            result = resize(storage, size)
            live.observe(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def __exit__(self) -> None:
        if self._own_attribute is self._ABSENT:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._own_attribute  # type: ignore[method-assign]


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or results (nested tuples, lists and dicts)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages that really hold `tensor`'s data: a wrapper subclass's inner tensors', recursively."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        for name in inner_names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # flatten may also name non-tensors (a device mesh)
                yield from _storages(inner)
        return
    if tensor.layout != torch.strided or tensor.is_meta:
        return  # sparse/mkldnn have no single storage; meta holds no memory
    try:
        yield tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return  # tensors without a usable storage (functional wrappers, some C++ subclasses)
