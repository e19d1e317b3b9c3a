"""Timings on this rank's device: matmuls, copies, tiny ops, collectives and sends.

The device picks the clock: CUDA events on a GPU (the time the GPU spent, launch to finish), wall-clock
perf_counter on the CPU. Every number is the median over repeats (fit.median), the statistic `verify
--measure` reports of a training run: on a busy machine the scheduler's hiccups are part of what a
training step pays (lower quartiles, used before, sat below what the training runs measured).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

from autoplan.calibrate.fit import median
from autoplan.runtime.components.optimizer import adamw

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Profile dtype name -> the tensor dtype timed ("tf32" is fp32 with TF32 tensor cores allowed)."""
MIN_TIMED_SECONDS = 0.03
"""Short ops are repeated until about this much time is sampled (at least MIN_REPEATS times)."""
MIN_REPEATS, MAX_REPEATS = 5, 50
TINY_OP_LOOP = 500
"""Tiny ops per timed loop: the per-op cost is the loop time over this count."""


class Clock:
    """Times a callable on `device`, one sample per call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def numbers(self, values: list[float]) -> torch.Tensor:
        """`values` as a float64 tensor on the device the process group communicates on: the GPU under NCCL
        (which has no CPU backend: "No backend type associated with device type cpu"), else the CPU. Every
        tensor a probe hands to a collective comes from here."""
        return torch.tensor(values, dtype=torch.float64, device=self.device if self.cuda else "cpu")

    def seconds(self, fn: Callable[[], object]) -> float:
        """Seconds of `fn` (median) after one warm-up call, repeated to about MIN_TIMED_SECONDS."""
        fn()
        self.sync()
        first = self.once(fn)
        repeats = min(MAX_REPEATS, max(MIN_REPEATS, math.ceil(MIN_TIMED_SECONDS / max(first, 1e-9))))
        return median([first] + [self.once(fn) for _ in range(repeats - 1)])


def matmul_flops_per_s(clock: Clock, dtype_names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """Achieved FLOP/s of square n x n @ n x n matmuls (2 n^3 FLOPs) per dtype and n. A dtype the
    device cannot multiply is left out."""
    rates: dict[str, dict[int, float]] = {}
    for name in dtype_names:
        by_size = {}
        with tf32_matmuls(name == "tf32"):
            for n in sizes:
                a = torch.randn(n, n, device=clock.device).to(DTYPES[name])
                b = torch.randn(n, n, device=clock.device).to(DTYPES[name])
                try:
                    by_size[n] = 2 * n**3 / clock.seconds(lambda: torch.mm(a, b))
                except RuntimeError:  # e.g. no fp16 matmul kernel on this device
                    break
        if by_size:
            rates[name] = by_size
    return rates


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """fp32 CUDA matmuls on TF32 tensor cores inside the block (`enabled`) or in full fp32, restored after.
    Through torch's fp32_precision setting where torch has it (2.9+): torch refuses to read the legacy
    allow_tf32 flag once the new setting was used ("mix of the legacy and new APIs"), so the two are never
    mixed; the legacy flag only on a torch without the new one."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    name, value = ("fp32_precision", "tf32" if enabled else "ieee") if new_api else ("allow_tf32", enabled)
    before = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def copy_bytes_per_s(clock: Clock, sizes: tuple[int, ...]) -> dict[int, float]:
    """Bytes moved per second (one read + one write per byte) by dst.copy_(src) of each size."""
    rates = {}
    for nbytes in sizes:
        src = torch.ones(nbytes // 4, device=clock.device)
        dst = torch.empty_like(src)
        rates[nbytes] = 2 * src.numel() * 4 / clock.seconds(lambda dst=dst, src=src: dst.copy_(src))
        del src, dst
    return rates


def tiny_op_seconds(clock: Clock) -> float:
    """Cost of one tiny op (add of 1-element tensors): dispatch on the CPU, launch on a GPU."""
    a = torch.ones(1, device=clock.device)
    b = torch.ones(1, device=clock.device)

    def loop():
        for _ in range(TINY_OP_LOOP):
            torch.add(a, b)

    return clock.seconds(loop) / TINY_OP_LOOP


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only the first
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def _reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(shard, full, group=group)


def _slowest(clock: Clock, samples: list[float], group) -> float:
    """Median over repeats of the slowest rank's time: a collective ends when its last rank does."""
    times = clock.numbers(samples)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return median(times.tolist())


def _communication_seconds(clock: Clock, op: Callable[[], object], group, repeats: int) -> float:
    """Seconds of a communicating `op` that every rank of `group` runs (a no-op on ranks that sit
    out), each repeat started together after a barrier."""
    op()  # warm-up: connection set-up and buffer allocation
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        clock.sync()
        samples.append(clock.once(op))
    return _slowest(clock, samples, group)


def collective_seconds(clock: Clock, group, group_size: int, message_bytes: tuple[int, ...],
                       repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of all-reduce, all-gather and reduce-scatter of each message size (the full,
    unsharded fp32 tensor) in `group`. Every rank of the group calls this."""
    found: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
    for nbytes in message_bytes:
        shard_numel = max(1, nbytes // 4 // group_size)
        full = torch.ones(shard_numel * group_size, device=clock.device)
        shard = torch.ones(shard_numel, device=clock.device)
        ops = {"all_reduce": lambda: dist.all_reduce(full, group=group),
               "all_gather": lambda: _all_gather(full, shard, group),
               "reduce_scatter": lambda: _reduce_scatter(shard, full, group)}
        for name, op in ops.items():
            found[name][full.numel() * 4] = _communication_seconds(clock, op, group, repeats)
    return found


def p2p_seconds(clock: Clock, pairs: list[tuple[int, int]], message_bytes: tuple[int, ...], repeats: int,
                group) -> dict[int, float]:
    """One-way time of a send between the ranks of each pair (half a ping-pong round trip), slowest
    pair, per message size. Every rank of `group` calls this; ranks in no pair only join the max."""
    rank = dist.get_rank()
    partner, first = None, False
    for a, b in pairs:
        if rank in (a, b):
            partner, first = (b, True) if rank == a else (a, False)
    found = {}
    for nbytes in message_bytes:
        buffer = torch.ones(max(1, nbytes // 4), device=clock.device)

        def ping_pong():
            if partner is None:
                return
            if first:
                dist.send(buffer, partner)
                dist.recv(buffer, partner)
            else:
                dist.recv(buffer, partner)
                dist.send(buffer, partner)

        found[buffer.numel() * 4] = _communication_seconds(clock, ping_pong, group, repeats) / 2
    return found


def spread(values: list[float]) -> float:
    """(max - min) / median of per-rank numbers: how much the ranks disagreed."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


OPTIMIZER_TENSORS = 64
"""Tiny parameter tensors in the timed AdamW step: its per-tensor cost is the step time over this count."""


def optimizer_tensor_overhead_seconds(clock: Clock) -> float:
    """Time torch.optim.AdamW, as train.py runs it (runtime.adamw, fused), spends per parameter tensor of one
    element, seconds: the host cost of its kernels."""
    params = [torch.nn.Parameter(torch.ones(1, device=clock.device)) for _ in range(OPTIMIZER_TENSORS)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = adamw(params, lr=1e-3)
    return clock.seconds(optimizer.step) / OPTIMIZER_TENSORS


def comm_overlap_fraction(clock: Clock, message_bytes: int, matmul_n: int) -> float:
    """Share of an all-reduce's time hidden when it runs beside compute on every rank:
    (T_compute + T_comm - T_together) / min(T_compute, T_comm), in [0, 1]. The compute is enough
    n x n matmuls to last about as long as the all-reduce."""
    full = torch.ones(message_bytes // 4, device=clock.device)
    a = torch.randn(matmul_n, matmul_n, device=clock.device)
    comm_s = _communication_seconds(clock, lambda: dist.all_reduce(full), None, 7)
    one_matmul = clock.seconds(lambda: torch.mm(a, a))
    count = max(1, round(comm_s / one_matmul))

    def compute():
        for _ in range(count):
            torch.mm(a, a)

    def together():
        work = dist.all_reduce(full, async_op=True)
        compute()
        work.wait()

    compute_s = _communication_seconds(clock, compute, None, 7)
    both_s = _communication_seconds(clock, together, None, 7)
    hidden = (compute_s + comm_s - both_s) / min(compute_s, comm_s)
    return min(1.0, max(0.0, hidden))


def transformer_layers(device: torch.device, count: int = 1) -> torch.nn.Module:
    """`count` small transformer layers (width 128, 4 heads, MLP 512), seeded: the compute every
    training-like probe of a calibration runs (matmuls, attention, norms and elementwise ops)."""
    torch.manual_seed(0)
    layers = (torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True) for _ in range(count))
    return torch.nn.Sequential(*layers).to(device)


def _transformer_step(device: torch.device) -> Callable[[], None]:
    """Forward+backward of a small transformer layer, as a training step mixes its ops."""
    layer = transformer_layers(device)
    x = torch.randn(8, 64, 128, device=device)

    def step():
        layer(x).sum().backward()

    return step


SLOWDOWN_TRIALS = 5
"""Alternating (rank 0 alone, all ranks together) timings; the median ratio is kept: a virtual
machine's steal time comes and goes."""


def concurrent_slowdown(clock: Clock) -> float:
    """How much slower a training-like step runs when every rank runs it at once than when rank 0 runs
    it alone (the others waiting at a barrier): > 1 where ranks share caches, memory bandwidth or a
    hypervisor's cores (a CPU), ~1 on GPUs. The same on every rank (a collective)."""
    step = _transformer_step(clock.device)
    ratios = []
    for _ in range(SLOWDOWN_TRIALS):
        dist.barrier()
        alone = clock.numbers([clock.seconds(step) if dist.get_rank() == 0 else 0.0])
        dist.barrier()
        dist.broadcast(alone, 0)
        together = clock.numbers([clock.seconds(step)])
        dist.all_reduce(together)
        ratios.append(together.item() / dist.get_world_size() / alone.item())
    return max(1.0, statistics.median(ratios))
