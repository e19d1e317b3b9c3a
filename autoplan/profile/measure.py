"""Time one op, forward and backward, on real random tensors on this machine's CPU.

Runs with one intra-op thread: `--gpu cpu` plans one training process per core (verify launches the
ranks with OMP_NUM_THREADS=1), and a single thread is also far less disturbed by a busy machine than a
team of spinning OpenMP threads. One measurement per signature, cached.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from autoplan.profile.replay import OpCall, backward_inputs, make_inputs, output_tensors

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Untimed runs first: the first call pays for allocator growth and kernel selection."""
MIN_TIMED_RUNS = 5
"""At least this many timed runs; the median is reported (robust to a stray scheduler hiccup)."""
MAX_TIMED_RUNS = 25
"""Short ops are repeated up to this many times, until MIN_TIMED_SECONDS of samples are collected."""
MIN_TIMED_SECONDS = 0.002
"""Enough samples of a microsecond-scale op to see past a descheduled thread on a busy machine."""


@dataclass(frozen=True)
class Timing:
    forward_s: float
    backward_s: float


def _median_seconds(run: Callable[[], object]) -> float:
    for _ in range(WARMUP_RUNS):
        run()
    samples: list[float] = []
    while len(samples) < MIN_TIMED_RUNS or (sum(samples) < MIN_TIMED_SECONDS and len(samples) < MAX_TIMED_RUNS):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_call(call: OpCall) -> Timing:
    """Median forward and backward wall time of `call` on CPU tensors, seconds."""
    with torch.set_grad_enabled(call.grad_enabled):
        leaves, _ = make_inputs(call, fill=True)
        mutable = call.target._schema.is_mutable

        def forward():
            # In-place ops may not mutate a leaf that requires grad: give them fresh clones each run.
            passed = [t.clone() if mutable and t.requires_grad else t for t in leaves]
            args, kwargs = call.materialize(passed)
            return call.target(*args, **kwargs)

        forward_s = _median_seconds(forward)
        backward = backward_inputs(leaves, output_tensors(forward()))
        backward_s = 0.0
        if backward is not None:
            differentiable, wrt, grads = backward
            backward_s = _median_seconds(
                lambda: torch.autograd.grad(differentiable, wrt, grads, retain_graph=True, allow_unused=True))
    return Timing(forward_s, backward_s)


THREADS_PER_RANK = 1
"""Intra-op threads of one CPU training process (see the module docstring)."""


class CpuTimer:
    """measure_call with a cache by signature; None for ops that cannot run on random tensors."""

    def __init__(self) -> None:
        self.cache: dict[tuple, Timing | None] = {}

    def __call__(self, call: OpCall) -> Timing | None:
        key = call.key
        if key not in self.cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(THREADS_PER_RANK)
            try:
                self.cache[key] = measure_call(call)
            except Exception as e:  # noqa: BLE001 - e.g. an op that needs meaningful values: estimate it instead
                log.warning("cannot time %s on random inputs (%s: %s); estimating it", call.target,
                            type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
                self.cache[key] = None
            finally:
                torch.set_num_threads(threads)
        return self.cache[key]
