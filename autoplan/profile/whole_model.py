"""Time the whole model, forward, loss and backward, on this machine's CPU at two batch sizes.

Ops timed one by one (measure.py) miss how they run together: an op replayed alone starts with cold
caches and pays the autograd engine's start-up for its backward, while in the model consecutive ops
share caches and one backward pass runs them all. The sum over ops is the right *shape* (which module
costs what, how time grows with the batch) but not the right total. Two whole-model timings fix the
total: the cost model rescales the per-op times' fixed and per-sample parts so that their sum at these
two batch sizes is what the real model takes (cost/compute.py, `MeasuredScale`).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from autoplan.profile.measure import THREADS_PER_RANK
from autoplan.contract import ModelSource, call_model, call_user, compute_loss

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 8)
"""Samples per timed forward+backward: a pipeline's smallest micro-batch and a typical one."""
WARMUP_RUNS, TIMED_RUNS = 2, 9
"""Runs per batch size; the median of the timed ones is kept. A shared machine's speed drifts by tens of
percent within seconds: many samples, the batch sizes taking turns."""
MIN_TIMED_SECONDS = 2.0
"""Small models keep taking turns until this long has been timed (at most MAX_TIMED_RUNS): on this
project's VM one 0.7 s median of a small GPT ranged 54-74 ms over a minute, and a plan timed in a fast
second under-predicted every layout's training run by ~20%."""
MAX_TIMED_RUNS = 60
MAX_PARAMETER_BYTES = 2**30
"""Largest model (parameter bytes) built for real to be timed; larger ones keep the per-op sums."""
MAX_SECONDS_PER_RUN = 2.0
"""A forward+backward slower than this at the smallest batch is not repeated (planning stays fast)."""


def _step(source: ModelSource, model, inputs, targets):
    """One forward, loss and backward: what a training step computes (the loss is not in the captured
    graph, so the rescaled op times carry it)."""
    def step():
        compute_loss(source.loss_fn, call_model(model, inputs), targets).backward()
        model.zero_grad(set_to_none=True)

    return step


def time_whole_model(source: ModelSource, parameter_bytes: float) -> dict[int, float]:
    """Median forward+backward seconds of the real model per batch size in BATCH_SIZES, one thread;
    empty when the model is too large to build or too slow to repeat here."""
    if parameter_bytes > MAX_PARAMETER_BYTES:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS_PER_RANK)
    try:
        torch.manual_seed(0)
        model = call_user(source, f"{source.factory_name}()", source.build_model)
        model.train()
        steps = {}
        for batch_size in BATCH_SIZES:
            inputs, targets = call_user(source, f"example_batch({batch_size})", source.example_batch, batch_size)
            steps[batch_size] = _step(source, model, inputs, targets)
        samples: dict[int, list[float]] = {b: [] for b in BATCH_SIZES}
        timed, run = 0.0, 0
        while run < WARMUP_RUNS + TIMED_RUNS or (timed < MIN_TIMED_SECONDS and run < WARMUP_RUNS + MAX_TIMED_RUNS):
            for batch_size, step in steps.items():  # the batch sizes take turns: both see the same machine
                started = time.perf_counter()
                step()
                seconds = time.perf_counter() - started
                if run >= WARMUP_RUNS:
                    samples[batch_size].append(seconds)
                    timed += seconds
                elif seconds > MAX_SECONDS_PER_RUN:
                    log.debug("whole-model timing skipped: %.1f s per forward+backward at batch %d", seconds, batch_size)
                    return {}
            run += 1
        return {b: statistics.median(times) for b, times in samples.items()}
    finally:
        torch.set_num_threads(threads)
