"""Time one op, forward and backward, on real random tensors on this machine's device.

On a GPU with CUDA events; on the CPU with wall-clock timers and one intra-op thread: `--gpu cpu` plans
one training process per core (verify launches the ranks with OMP_NUM_THREADS=1), and a single thread
is also far less disturbed by a busy machine than a team of spinning OpenMP threads. Each signature is
measured once (repeated layers share it) and kept in an on-disk cache (timing_cache.py).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from autoplan.profile.replay import OpCall, backward_inputs, make_inputs, output_tensors
from autoplan.profile.timing_cache import TimingCache

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Untimed runs first: the first call pays for allocator growth and kernel selection."""
MIN_TIMED_RUNS = 5
"""At least this many timed runs; the median is reported (robust to a stray scheduler hiccup)."""
MAX_TIMED_RUNS = 25
"""Short ops are repeated up to this many times, until MIN_TIMED_SECONDS of samples are collected."""
MIN_TIMED_SECONDS = 0.002
"""Enough samples of a microsecond-scale op to see past a descheduled thread on a busy machine."""
THREADS_PER_RANK = 1
"""Intra-op threads of one CPU training process (see the module docstring)."""
MAX_TIMED_OP_BYTES = 1 << 30
"""Largest op (inputs + outputs, bytes) materialized to be timed: 1 GiB, so that --measure on a model
larger than this machine estimates its biggest ops instead of exhausting memory."""


@dataclass(frozen=True)
class Timing:
    forward_s: float
    backward_s: float


def measure_device() -> str:
    """"cuda" when a GPU is present, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_description(device: str, float_dtype: torch.dtype | None = None) -> str:
    """What timings depend on besides the op: the processor (or GPU), the torch version and the dtype float32
    inputs are timed in."""
    if device == "cuda":
        hardware = torch.cuda.get_device_name()
    else:
        hardware = f"{platform.machine()} {platform.processor() or 'cpu'} x{THREADS_PER_RANK} thread"
    timed = f"; float inputs in {str(float_dtype).removeprefix('torch.')}" if float_dtype is not None else ""
    return f"{device}: {hardware}; torch {torch.__version__}{timed}"


def _median_seconds(run: Callable[[], object], device: str) -> float:
    for _ in range(WARMUP_RUNS):
        run()
    samples: list[float] = []
    while len(samples) < MIN_TIMED_RUNS or (sum(samples) < MIN_TIMED_SECONDS and len(samples) < MAX_TIMED_RUNS):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            start_s = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start_s)
    return statistics.median(samples)


TIMED_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
"""Training dtype -> the dtype an op's float32 inputs are timed in on a GPU (None: as captured). A bf16 plan
trains under FSDP2's MixedPrecisionPolicy or autocast, so its ops run on bf16 tensors; ops a model itself runs
in fp32 (an RMSNorm's variance) are timed in bf16 too. On the CPU ops are timed as captured (fp32): CPU plans
train in fp32."""


def timed_dtype(device: str, train_dtype: str) -> torch.dtype | None:
    """The dtype float32 op inputs are timed in on `device` for a plan training in `train_dtype`."""
    return TIMED_DTYPES.get(train_dtype) if device == "cuda" else None


def measure_call(call: OpCall, device: str = "cpu", float_dtype: torch.dtype | None = None) -> Timing:
    """Median forward and backward time of `call` on random tensors on `device` (float32 inputs in
    `float_dtype` when given), seconds."""
    with torch.device(device), torch.set_grad_enabled(call.grad_enabled):
        leaves, _ = make_inputs(call, fill=True, float_dtype=float_dtype)
        mutable = call.target._schema.is_mutable

        def forward():
            # In-place ops may not mutate a leaf that requires grad: give them fresh clones each run.
            passed = [t.clone() if mutable and t.requires_grad else t for t in leaves]
            args, kwargs = call.materialize(passed)
            return call.target(*args, **kwargs)

        forward_s = _median_seconds(forward, device)
        backward = backward_inputs(leaves, output_tensors(forward()))
        backward_s = 0.0
        if backward is not None:
            differentiable, wrt, grads = backward
            backward_s = _median_seconds(
                lambda: torch.autograd.grad(differentiable, wrt, grads, retain_graph=True, allow_unused=True), device)
    return Timing(forward_s, backward_s)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class OpTimer:
    """measure_call with a cache by signature (in memory and on disk); None for an op that cannot be
    timed, with the reason in `errors`."""

    def __init__(self, cache: TimingCache, device: str = "cpu", float_dtype: torch.dtype | None = None) -> None:
        self.cache = cache
        self.device = device
        self.float_dtype = float_dtype
        """The dtype float32 inputs are timed in (timed_dtype), None: as captured."""
        self.errors: dict[str, str] = {}
        """Op (target name) -> why it could not be timed."""
        self.measured = 0
        """Signatures timed in this run (not found in the cache)."""

    def __call__(self, call: OpCall, op_bytes: int) -> Timing | None:
        signature = repr(call.key)
        entry = self.cache.get(signature)
        if entry is None:
            entry = self._measure(call, op_bytes)
            self.cache.put(signature, entry)
        if isinstance(entry, str):
            self.errors.setdefault(str(call.target), entry)
            return None
        return Timing(float(entry[0]), float(entry[1]))

    def _measure(self, call: OpCall, op_bytes: int) -> list[float] | str:
        if op_bytes > MAX_TIMED_OP_BYTES:
            return f"{op_bytes / 2**30:.1f} GiB of tensors, over the {MAX_TIMED_OP_BYTES / 2**30:.0f} GiB timing limit"
        self.measured += 1
        threads = torch.get_num_threads()
        if self.device == "cpu":
            torch.set_num_threads(THREADS_PER_RANK)
        try:
            timing = measure_call(call, self.device, self.float_dtype)
            return [timing.forward_s, timing.backward_s]
        except Exception as e:  # noqa: BLE001 - e.g. an op that needs meaningful values: estimate it instead
            log.debug("cannot time %s on random inputs: %s", call.target, _one_line(e))
            return _one_line(e)
        finally:
            torch.set_num_threads(threads)
