"""Price one layout with one stage split: per-stage time and memory, step time, MFU.

Step time (seconds) for p stages, m micro-batches, the slot of the slowest stage b:

    slot_s = compute_s + exposed FSDP gathers per micro-batch + p2p sends (activation out, gradient in)
    step   = (m + p - 1) x slot_b                      pipeline: busy + bubble (cost/pipeline.py)
           + max_s exposed gradient reduction          (cost/comm.py)
           + all-reduce of tied parameters split over stages
           + max_s AdamW step                          (cost/compute.py)

Ranks are ordered dp outermost, then pp, then tp: the data-parallel group has stride pp x tp, the
pipeline group stride tp (so tensor parallelism will stay inside a node).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost import comm
from autoplan.cost.compute import mfu, model_flops_per_step, optimizer_step_time, unit_times
from autoplan.cost.dtypes import activation_scale, bytes_per_element
from autoplan.cost.memory import stage_memory_model
from autoplan.cost.pipeline import pipeline_time
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, Prediction, Stage, Training
from autoplan.solve.layers import LayerChain
from autoplan.solve.problem import ChainProblem, Split

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as GiB for messages: one decimal, or two significant digits below 1 GiB."""
    value = nbytes / GIB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.2g}"


@dataclass(frozen=True)
class Candidate:
    """One layout the search tried."""

    parallelism: Parallelism
    stages: tuple[Stage, ...]
    """Stage split and per-stage predictions; empty when pruned before a split was chosen."""
    predicted: Prediction | None
    """None when pruned by the memory lower bound."""
    fits: bool
    reason: str
    """"" for the winner, else why it lost ("OOM by 12.4 GiB on stage 0", "8% slower than the best")."""
    memory_needed_bytes: float = 0.0
    """Peak memory per GPU of the split shown (the leanest split when none fits; a lower bound when
    pruned, exact once an Infeasible message needed it)."""


def build_problem(chain: LayerChain, cluster: Cluster, training: Training, par: Parallelism) -> ChainProblem:
    times = unit_times(chain, cluster.gpu, training.dtype, par.pipeline_parallel_microbatch_size)
    models = tuple(stage_memory_model(chain, par, training.dtype, s) for s in range(par.pipeline_parallel_degree))
    return ChainProblem(times.total, models, cluster.usable_memory_bytes)


def stage_unit_numels(chain: LayerChain, start: int, end: int) -> list[float]:
    """Parameter elements per unit of a stage, a tied parameter counted once (at its first unit)."""
    numels = [float(u.exclusive_parameter_numel) for u in chain.units[start:end]]
    for group in chain.tied_groups:
        held = [u for u in group.units if start <= u < end]
        if held:
            numels[held[0] - start] += group.numel
    return numels


def evaluate_split(chain: LayerChain, cluster: Cluster, training: Training, par: Parallelism,
                   problem: ChainProblem, split: Split, fits: bool, reason: str = "") -> Candidate:
    """Predictions for `par` with stages `split` (memory models and unit times from `problem`)."""
    dp, pp, tp = par.data_parallel_degree, par.pipeline_parallel_degree, par.tensor_parallel_degree
    m, mbs = par.pipeline_parallel_num_microbatches, par.pipeline_parallel_microbatch_size
    times = unit_times(chain, cluster.gpu, training.dtype, mbs)
    element = bytes_per_element(training.dtype)
    act = activation_scale(chain.capture_dtype, training.dtype) * mbs
    dp_link, pp_link = cluster.link_for(dp, stride=pp * tp), cluster.link_for(pp, stride=tp)
    n = len(chain)
    stages, slots, compute, per_mb_dp, per_step_dp, p2p, optimizer = [], [], [], [], [], [], []
    for s, (a, b) in enumerate(split.ranges()):
        fwd, bwd = sum(times.fwd[a:b]), sum(times.bwd[a:b])
        numels = stage_unit_numels(chain, a, b)
        if par.zero_stage == 3:
            streaming = cluster.gpu.memory_bandwidth_bytes_per_s * cluster.gpu.memory_efficiency
            dpc = comm.fsdp_comm([x * element for x in numels], dp, dp_link, pp, m, fwd, bwd, streaming)
        else:  # ZeRO 1/2 move the same 2 Psi as an all-reduce (reduce-scatter + all-gather)
            dpc = comm.ddp_comm(sum(numels) * element, dp, dp_link, bwd)
        sends = (comm.p2p_s(chain.cut_bytes[b - 1] * act, pp_link) if b < n else 0.0) + \
                (comm.p2p_s(chain.cut_bytes[a - 1] * act, pp_link) if a > 0 else 0.0)
        updated = sum(numels) / (dp if par.zero_stage >= 1 else 1)
        compute.append(fwd + bwd)
        per_mb_dp.append(dpc.per_microbatch_s)
        per_step_dp.append(dpc.per_step_s)
        p2p.append(sends)
        optimizer.append(optimizer_step_time(updated, cluster.gpu))
        slots.append(fwd + bwd + dpc.per_microbatch_s + sends)
        breakdown = problem.memory[s].breakdown(a, b)
        stages.append(Stage(index=s, modules=chain.fqns[a:b], predicted_time_s=fwd + bwd,
                            predicted_memory_bytes=sum(breakdown.values()), memory_breakdown=breakdown))
    slowest = max(range(pp), key=lambda s: slots[s])
    pipe = pipeline_time(slots[slowest], pp, m)
    time_breakdown = {
        "compute": m * compute[slowest],
        "bubble": pipe.bubble_s,
        "data_parallel_comm": m * per_mb_dp[slowest] + max(per_step_dp),
        "pipeline_comm": m * p2p[slowest] + _tied_gradient_sync(chain, split, element, pp_link),
        "optimizer": max(optimizer),
    }
    step = sum(time_breakdown.values())
    peak = max(stages, key=lambda st: st.predicted_memory_bytes)
    flops = model_flops_per_step(chain, training.global_batch_size)
    tokens = training.tokens_per_sample or chain.tokens_per_sample
    predicted = Prediction(
        step_time_s=step,
        samples_per_s=training.global_batch_size / step,
        tokens_per_s=training.global_batch_size * tokens / step if tokens else None,
        model_flops_per_step=flops,
        mfu=mfu(flops, step, par.world_size, cluster.gpu, training.dtype),
        peak_memory_bytes=peak.predicted_memory_bytes,
        memory_breakdown=dict(peak.memory_breakdown),
        time_breakdown=time_breakdown,
    )
    return Candidate(par, tuple(stages), predicted, fits, reason, peak.predicted_memory_bytes)


def _tied_gradient_sync(chain: LayerChain, split: Split, element: int, link) -> float:
    """Stages holding copies of one tied parameter all-reduce its gradient once per step."""
    stage_of = {u: s for s, (a, b) in enumerate(split.ranges()) for u in range(a, b)}
    total = 0.0
    for group in chain.tied_groups:
        holders = len({stage_of[u] for u in group.units})
        total += comm.all_reduce_s(group.numel * element, holders, link)
    return total


def oom_reason(candidate: Candidate, cap_bytes: float) -> str:
    worst = max(candidate.stages, key=lambda st: st.predicted_memory_bytes)
    return f"OOM by {gib(worst.predicted_memory_bytes - cap_bytes)} GiB on stage {worst.index}"
