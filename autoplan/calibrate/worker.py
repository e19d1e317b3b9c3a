"""One rank of `autoplan calibrate`, run under torchrun: measure, gather, and (rank 0) write the profile.

    python -m torch.distributed.run --nproc-per-node K -m autoplan.calibrate.worker --out PROFILE.yaml

The device picks the backend: CUDA/NCCL when a GPU is present (one GPU per rank, LOCAL_RANK) and the
base profile is not "cpu", else CPU/gloo with one intra-op thread per rank (one rank = one process on one core, as `autoplan verify`
runs ranks and as the profiler times ops). All ranks measure at once, as they would train.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoplan.calibrate import frameworks, measure
from autoplan.calibrate.fit import bus_factor, median, op_fits
from autoplan.calibrate.types import SIZES, Measurements, TierTimes
from autoplan.calibrate.writer import default_base, write_profile
from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware
from autoplan.procs import exit_skipping_teardown


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise UserError(f"${name} is {value!r}: run calibrate under torchrun, or plainly (it launches torchrun)")
    return int(value)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _resident_bytes() -> float:
    """This process's resident set size, bytes (Linux /proc; elsewhere the peak RSS)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return float(pages * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


def _per_rank_median_of(values):
    if isinstance(values[0], dict):
        return {key: _per_rank_median_of([v[key] for v in values]) for key in values[0]}
    return median(values)


def _node_groups(world: int, per_node: int):
    """This rank's node group (every rank creates every group, in the same order) and its size.
    torchrun numbers ranks node by node: node k holds ranks k * per_node .. (k + 1) * per_node - 1."""
    if per_node >= world:
        return None, world
    mine = None
    for start in range(0, world, per_node):
        ranks = list(range(start, min(world, start + per_node)))
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine, per_node


def _tier(clock: measure.Clock, group, size: int, pairs: list[tuple[int, int]], sizes) -> TierTimes:
    seconds = measure.collective_seconds(clock, group, size, sizes.message_bytes, sizes.repeats)
    seconds["p2p"] = measure.p2p_seconds(clock, pairs, sizes.message_bytes, sizes.repeats, group)
    return TierTimes(group_size=size, seconds=seconds)


def _measure_tiers(clock: measure.Clock, world: int, per_node: int, sizes) -> dict[str, TierTimes]:
    """Intra-node links among the ranks of each node, inter-node links across the whole world; a tier
    that cannot be measured (one node, or one rank per node) is a copy of the other."""
    tiers = {}
    if per_node >= 2:
        node_group, node_size = _node_groups(world, per_node)
        pairs = [(s + i, s + i + 1) for s in range(0, world, per_node) for i in range(0, node_size - 1, 2)]
        tiers["intra_node"] = _tier(clock, node_group, node_size, pairs, sizes)
    if per_node < world:  # pair each rank of an even node with the same local rank of the next node
        cross = [(r, r + per_node) for r in range(world) if (r // per_node) % 2 == 0 and r + per_node < world]
        tiers["inter_node"] = _tier(clock, None, world, cross, sizes)
    if "inter_node" not in tiers:
        intra = tiers["intra_node"]
        tiers["inter_node"] = TierTimes(intra.group_size, intra.seconds, copied_from="intra_node")
    if "intra_node" not in tiers:
        inter = tiers["inter_node"]
        tiers["intra_node"] = TierTimes(inter.group_size, inter.seconds, copied_from="inter_node")
    return tiers


def _op_seconds(tier: TierTimes, op: str, nbytes: int) -> float:
    """What the cost model charges one `op` of `nbytes` on `tier`: its per-operation alpha-beta fit
    (calibrate/writer.py writes the same fits), nccl-tests bus factors."""
    fit = op_fits(tier.seconds, tier.group_size)[op]
    return fit.latency_s + nbytes * bus_factor(op, tier.group_size) / fit.bus_bandwidth_bytes_per_s


def _fsdp_collectives_seconds(tier: TierTimes, unit_bytes: int) -> float:
    """What the cost model charges a unit's two all-gathers and one reduce-scatter of `unit_bytes`."""
    return 2 * _op_seconds(tier, "all_gather", unit_bytes) + _op_seconds(tier, "reduce_scatter", unit_bytes)


ONE_RANK = ("one rank: links, overlap and the parallel wrappers' host costs need 2 or more ranks (launch "
            "--nproc 2 or more on a machine with 2 or more devices to measure them)")
"""Why a calibration on one rank (a one-GPU machine) measures only the single-device numbers."""


@dataclass(frozen=True)
class BetweenRanks:
    """What a calibration measures among its ranks: the framework probes (comm_overlap and the host costs of
    FSDP2, DDP, DTensor and pipelining, each rank's medians) and rank 0's pipeline fit. Empty on one rank."""

    framework: dict[str, float] = field(default_factory=dict)
    pipeline_constant: float | None = None
    pipeline_slowdown: float | None = None


def _median_over_ranks(framework: list[dict], name: str) -> float | None:
    values = [f[name] for f in framework if name in f]
    return median(values) if values else None


def _measure_between_ranks(clock: measure.Clock, device: torch.device, world: int, per_node: int,
                           sizes) -> tuple[dict[str, TierTimes], BetweenRanks]:
    """The link tiers and the framework probes, on 2 or more ranks; nothing on one (ONE_RANK says why)."""
    if world == 1:
        return {}, BetweenRanks()
    tiers = _measure_tiers(clock, world, per_node, sizes)
    world_mesh = init_device_mesh(device.type, (world,))
    tier = tiers["inter_node" if per_node < world else "intra_node"]
    intra = tiers["intra_node"]
    p2p = op_fits(intra.seconds, intra.group_size)["p2p"].latency_s
    tp_all_reduce = _op_seconds(tier, "all_reduce", frameworks.tp_mlp_all_reduce_bytes())
    ddp_all_reduce = _op_seconds(tier, "all_reduce", frameworks.ddp_gradient_bytes())
    probed = frameworks.in_rounds({
        "comm_overlap": lambda: measure.comm_overlap_fraction(clock, sizes.overlap_message_bytes,
                                                              sizes.overlap_matmul_n),
        "fsdp_unit": lambda: frameworks.fsdp_unit_overhead_seconds(
            clock, world_mesh, lambda unit_bytes: _fsdp_collectives_seconds(tier, unit_bytes)),
        "optimizer_dtensor": lambda: frameworks.optimizer_dtensor_overhead_seconds(clock, world_mesh),
        "pipeline_small": lambda: frameworks.pipelined_stage_seconds(
            clock, p2p, frameworks.PIPELINE_MICROBATCH_SIZES[0]),
        "pipeline_large": lambda: frameworks.pipelined_stage_seconds(
            clock, p2p, frameworks.PIPELINE_MICROBATCH_SIZES[1]),
        "dtensor_op": lambda: frameworks.tensor_parallel_op_overhead_seconds(clock, world_mesh, tp_all_reduce),
        "ddp_tensor": lambda: frameworks.ddp_tensor_overhead_seconds(clock, ddp_all_reduce),
    })
    # rank 0's fit is written: its pairs are timed as the slowest rank's, split into forward and
    # backward by rank 0's own forward share
    constant, slowdown = frameworks.pipeline_overheads(probed.pop("pipeline_small"), probed.pop("pipeline_large"))
    return tiers, BetweenRanks(probed, constant, slowdown)


def run(out: Path, base: str | None, timeout_s: float) -> Measurements:
    """Measure on every rank; rank 0 writes `out`. Returns the measurements (on every rank)."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank, per_node = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    base_profile = load_hardware(base) if base else None
    # --gpu cpu means this machine's CPU even where a GPU is present (as everywhere in autoplan)
    cuda = torch.cuda.is_available() and not (base_profile and base_profile.gpu.name == "cpu")
    if not cuda and base_profile is not None and base_profile.gpu.name != "cpu":
        raise UserError(f"--gpu/--hardware {base} describes a GPU, but this machine has none: calibrate measures "
                        f"the device it runs on (drop the option, or use --gpu cpu)")
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    sizes = SIZES[device.type]
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if cuda else {}))
    try:
        load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        resident = _resident_bytes() if not cuda else 0.0
        clock = measure.Clock(device)
        local = {}  # each phase starts together on all ranks: they share caches and memory as in training
        dist.barrier()
        local["matmul"] = measure.matmul_flops_per_s(clock, sizes.matmul_dtypes, sizes.matmul_sizes)
        dist.barrier()
        local["copy"] = measure.copy_bytes_per_s(clock, sizes.copy_bytes)
        dist.barrier()
        local["tiny_op"] = measure.tiny_op_seconds(clock)
        local["optimizer_tensor"] = measure.optimizer_tensor_overhead_seconds(clock)
        slowdown = measure.concurrent_slowdown(clock) if world > 1 else None
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        overheads = [g["tiny_op"] for g in gathered]
        matmul = _per_rank_median_of([g["matmul"] for g in gathered])
        copy = _per_rank_median_of([g["copy"] for g in gathered])
        tiers, between = _measure_between_ranks(clock, device, world, per_node, sizes)
        framework = [between.framework] * world if world == 1 else [None] * world
        if world > 1:
            dist.all_gather_object(framework, between.framework)
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            resident = float(total - free - torch.cuda.memory_reserved(device))
        residents = [None] * world
        dist.all_gather_object(residents, resident)
        found = Measurements(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=str(torch.__version__),
            device=device.type,
            device_name=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
            backend="nccl" if cuda else "gloo",
            world_size=world,
            ranks_per_node=per_node,
            threads_per_rank=torch.get_num_threads(),
            matmul_flops_per_s=matmul,
            copy_bytes_per_s=copy,
            kernel_overhead_s=median(overheads),
            tiers=tiers,
            resident_bytes=max(residents),
            device_memory_bytes=float(torch.cuda.get_device_properties(device).total_memory) if cuda else None,
            peak_allocated_bytes=float(torch.cuda.max_memory_allocated(device)) if cuda else None,
            devices_per_node=torch.cuda.device_count() if cuda else None,
            comm_overlap=between.framework.get("comm_overlap"),
            fsdp_unit_overhead_s=_median_over_ranks(framework, "fsdp_unit"),
            optimizer_dtensor_overhead_s=_median_over_ranks(framework, "optimizer_dtensor"),
            pipeline_microbatch_overhead_s=between.pipeline_constant,
            pipeline_compute_slowdown=between.pipeline_slowdown,
            concurrent_slowdown=slowdown,
            dtensor_op_overhead_s=_median_over_ranks(framework, "dtensor_op"),
            ddp_tensor_overhead_s=_median_over_ranks(framework, "ddp_tensor"),
            optimizer_tensor_overhead_s=median([g["optimizer_tensor"] for g in gathered]),
            links_not_measured=ONE_RANK if world == 1 else "",
            extra={"load_average_at_start": load_at_start, "cpu_count": float(os.cpu_count() or 0),
                   "kernel_overhead_spread": measure.spread(overheads),
                   "matmul_spread": measure.spread([max(max(by_n.values()) for by_n in g["matmul"].values())
                                                    for g in gathered])},
        )
        if rank == 0:
            if base is None:
                base = default_base(found.device, found.device_name)
                base_profile = load_hardware(base) if base else None
            write_profile(found, out, base_profile, base)
        dist.barrier()
        return found
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoplan.calibrate.worker")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--base", default=None, help="hardware profile name or YAML whose datasheet peaks to keep")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    args = parser.parse_args(argv)
    try:
        run(args.out, args.base, args.timeout)
    except UserError as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_skipping_teardown(main())
