"""Search over layouts: degrees, ZeRO stage, schedule, micro-batch size, and the stage split.

For every layout in scope (layouts.py) that respects the pins:
1. prune it when a memory lower bound already exceeds the cap (ChainProblem.memory_lower_bound);
2. split the chain with the exact DP (dp.py); no split fits -> report the leanest split's OOM;
3. price the split (evaluate.py).
The fastest fitting layout wins, except that step times within TIE_TOLERANCE of the fastest count
as equal and the simplest of those wins: fewer stages, then zero 0, then 1F1B, then the faster.
The winner's split is then solved again as a MILP (ilp.py), warm started and bounded by the DP, so
the plan carries the MILP solver's status and gap. (The DP is exact for today's chain problem and
takes microseconds; a MILP per layout would cost ~50 ms each. The MILP is the model that grows
with per-stage choices such as recomputation or tensor parallelism.)
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from autoplan.errors import Infeasible, UserError
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, SolverInfo, Training
from autoplan.profile.types import ModelProfile
from autoplan.solve import layouts
from autoplan.solve.dp import min_peak_memory_split, solve_dp
from autoplan.solve.evaluate import GIB, Candidate, gib, build_problem, evaluate_split, oom_reason
from autoplan.solve.ilp import resolve_solver, solve_ilp
from autoplan.solve.layers import LayerChain, build_chain
from autoplan.solve.pins import Pins
from autoplan.solve.problem import Split

TIE_TOLERANCE = 0.01
"""Predicted step times within 1% of the fastest are treated as equal: the cost model is not more
accurate than that, and a simpler program (no pipeline, no sharding) is worth more than the rest."""

LARGER_GPU_COUNTS_TRIED = 6
"""How many larger power-of-two GPU counts an Infeasible message looks at."""


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    candidates: tuple[Candidate, ...]
    """Every layout tried, the best first, then the other fitting ones by step time, then the rest."""
    solver: SolverInfo
    chain: LayerChain
    """The units the stages were cut from."""


def search(profile: ModelProfile, cluster: Cluster, training: Training, pins: Pins = Pins(),
           solver: str = "highs", time_limit_s: float | None = None) -> SearchResult:
    started = time.perf_counter()
    resolve_solver(solver)
    chain = build_chain(profile)
    layouts.check_pins(pins, cluster.num_gpus, training.global_batch_size, len(chain))
    options = layouts.enumerate_layouts(pins, cluster.num_gpus, training.global_batch_size, len(chain))
    if not options:
        raise UserError(f"no layout satisfies the pins '{pins.as_text()}' on {cluster.num_gpus} GPUs at global "
                        f"batch {training.global_batch_size} (dp must divide the batch, pp the GPU count)")
    tried = [_try_layout(chain, cluster, training, par) for par in options]
    fitting = sorted((c for c, _ in tried if c.fits), key=_by_time)
    if not fitting:
        raise Infeasible(_infeasible_message(chain, cluster, training, pins, [c for c, _ in tried]))
    splits = {id(c): split for c, split in tried}
    fastest = fitting[0].predicted.step_time_s
    chosen = min((c for c in fitting if c.predicted.step_time_s <= fastest * (1 + TIE_TOLERANCE)), key=_simplicity)
    best, info = _confirm_with_ilp(chain, cluster, training, chosen, splits[id(chosen)], solver, time_limit_s)
    ranked = [best] + [dataclasses.replace(c, reason=_losing_reason(c, best)) for c in fitting if c is not chosen]
    rest = sorted((c for c, _ in tried if not c.fits), key=lambda c: c.memory_needed_bytes)
    pinned = pins.dp is not None and pins.pp is not None
    info = dataclasses.replace(info, name="pinned" if pinned else info.name,
                               time_s=time.perf_counter() - started, candidates_evaluated=len(tried))
    return SearchResult(best, tuple(ranked + rest), info, chain)


def estimate(profile: ModelProfile, cluster: Cluster, training: Training, parallelism: Parallelism,
             stage_modules: tuple[tuple[str, ...], ...] | None = None, solver: str = "highs",
             time_limit_s: float | None = None) -> Candidate:
    """Price exactly one layout. The stage split is the optimal one unless `stage_modules` gives it."""
    chain = build_chain(profile)
    pins = Pins(dp=parallelism.data_parallel_degree, tp=parallelism.tensor_parallel_degree,
                pp=parallelism.pipeline_parallel_degree, zero=parallelism.zero_stage,
                schedule=parallelism.pipeline_parallel_schedule,
                microbatch=parallelism.pipeline_parallel_microbatch_size,
                recompute=parallelism.activation_checkpoint)
    layouts.check_pins(pins, cluster.num_gpus, training.global_batch_size, len(chain))
    per_rank = training.global_batch_size // parallelism.data_parallel_degree
    m = per_rank // parallelism.pipeline_parallel_microbatch_size
    if m != parallelism.pipeline_parallel_num_microbatches:
        raise UserError(f"pipeline_parallel_num_microbatches={parallelism.pipeline_parallel_num_microbatches}, but "
                        f"global batch {training.global_batch_size} / dp={parallelism.data_parallel_degree} / "
                        f"microbatch={parallelism.pipeline_parallel_microbatch_size} = {m}")
    if stage_modules is None:
        candidate, split = _try_layout(chain, cluster, training, parallelism)
        if candidate.fits and split is not None and split.num_stages > 1:
            candidate, _ = _confirm_with_ilp(chain, cluster, training, candidate, split, solver, time_limit_s)
        return candidate
    problem = build_problem(chain, cluster, training, parallelism)
    split = _split_from_modules(chain, stage_modules, parallelism.pipeline_parallel_degree)
    fits = problem.fits(split)
    candidate = evaluate_split(chain, cluster, training, parallelism, problem, split, fits)
    if fits:
        return candidate
    return dataclasses.replace(candidate, reason=oom_reason(candidate, problem.memory_cap_bytes))


def _try_layout(chain: LayerChain, cluster: Cluster, training: Training,
                par: Parallelism) -> tuple[Candidate, Split | None]:
    problem = build_problem(chain, cluster, training, par)
    cap = problem.memory_cap_bytes
    bound = problem.memory_lower_bound()
    if bound > cap:
        reason = f"OOM by at least {gib(bound - cap)} GiB (memory lower bound, no split tried)"
        return Candidate(par, (), None, False, reason, bound), None
    found = solve_dp(problem)
    if found is None:
        leanest = min_peak_memory_split(problem)
        candidate = evaluate_split(chain, cluster, training, par, problem, leanest.split, False)
        return dataclasses.replace(candidate, reason=oom_reason(candidate, cap)), leanest.split
    return evaluate_split(chain, cluster, training, par, problem, found.split, True), found.split


def _confirm_with_ilp(chain, cluster, training, candidate: Candidate, split: Split, solver: str,
                      time_limit_s: float | None) -> tuple[Candidate, SolverInfo]:
    """Re-solve the winner's split with the MILP, seeded and bounded by the DP's optimum."""
    name = resolve_solver(solver)
    if split.num_stages == 1:
        return candidate, SolverInfo(name=name, status="optimal", time_s=0.0, candidates_evaluated=1)
    par = candidate.parallelism
    problem = build_problem(chain, cluster, training, par)
    bound = problem.bottleneck(split)
    result = solve_ilp(problem, solver, time_limit_s, warm_start=split, upper_bound=bound)
    info = SolverInfo(name=result.solver, status=result.status, time_s=result.time_s, candidates_evaluated=1,
                      gap=result.gap)
    if result.split is not None and result.split != split and problem.fits(result.split) \
            and result.objective <= bound * (1 + 1e-9):
        # both splits are optimal for the slowest stage; keep whichever prices better overall
        other = evaluate_split(chain, cluster, training, par, problem, result.split, True)
        if other.predicted.step_time_s < candidate.predicted.step_time_s:
            candidate = other
    return candidate, info


def _by_time(c: Candidate) -> tuple:
    return (c.predicted.step_time_s, _simplicity(c))


def _simplicity(c: Candidate) -> tuple:
    par = c.parallelism
    schedule = layouts.SEARCHED_SCHEDULES.index(par.pipeline_parallel_schedule)
    return (par.pipeline_parallel_degree, par.zero_stage, schedule, c.predicted.step_time_s, -par.pipeline_parallel_microbatch_size, par.data_parallel_degree)


def _losing_reason(c: Candidate, best: Candidate) -> str:
    percent = (c.predicted.step_time_s - best.predicted.step_time_s) / best.predicted.step_time_s * 100
    if percent <= TIE_TOLERANCE * 100:
        return f"{percent:+.2f}% step time vs the best, a tie within {TIE_TOLERANCE:.0%}: the best is simpler"
    digits = 0 if percent >= 1 else 1
    return f"{percent:.{digits}f}% slower than the best"


def _split_from_modules(chain: LayerChain, stage_modules, num_stages: int) -> Split:
    flat = [fqn for stage in stage_modules for fqn in stage]
    if len(stage_modules) != num_stages or flat != list(chain.fqns) or any(not s for s in stage_modules):
        raise UserError(f"stage modules must list the {len(chain)} units {', '.join(chain.fqns)} in order, "
                        f"split into {num_stages} non-empty stages")
    bounds = [0]
    for stage in stage_modules:
        bounds.append(bounds[-1] + len(stage))
    return Split(tuple(bounds))


def _leanest(chain, cluster, training, candidates: list[Candidate]) -> Candidate:
    """The candidate needing the least memory per GPU, pruned ones solved exactly."""
    exact = []
    for c in candidates:
        if c.stages:
            exact.append(c)
            continue
        problem = build_problem(chain, cluster, training, c.parallelism)
        leanest = min_peak_memory_split(problem)
        exact.append(dataclasses.replace(c, memory_needed_bytes=leanest.value))
    return min(exact, key=lambda c: c.memory_needed_bytes)


def _larger_counts(num_gpus: int) -> list[int]:
    first = 2 ** math.ceil(math.log2(num_gpus + 1))
    return [first * 2**k for k in range(LARGER_GPU_COUNTS_TRIED)]


def _smallest_fitting_count(chain, cluster, training, pins: Pins) -> int | None:
    """The smallest larger power-of-two GPU count (dp pin dropped) at which some layout fits."""
    relaxed = dataclasses.replace(pins, dp=None)
    for count in _larger_counts(cluster.num_gpus):
        bigger = dataclasses.replace(cluster, num_gpus=count)
        for par in layouts.enumerate_layouts(relaxed, count, training.global_batch_size, len(chain)):
            problem = build_problem(chain, bigger, training, par)
            if problem.memory_lower_bound() <= problem.memory_cap_bytes and solve_dp(problem) is not None:
                return count
    return None


def _infeasible_message(chain, cluster, training, pins: Pins, candidates: list[Candidate]) -> str:
    cap = cluster.usable_memory_bytes
    leanest = _leanest(chain, cluster, training, candidates)
    needed = leanest.memory_needed_bytes
    message = (f"no layout fits {cluster.num_gpus} GPUs with {gib(cap)} GiB usable each: the leanest "
               f"({layouts.describe(leanest.parallelism)}) needs {gib(needed)} GiB per GPU")
    count = _smallest_fitting_count(chain, cluster, training, pins)
    largest = _larger_counts(cluster.num_gpus)[-1]
    if count is None:
        return message + (f"; no GPU count up to {largest} fits at global batch {training.global_batch_size} "
                          f"(try --memory-per-gpu {math.ceil(needed / GIB)}GiB)")
    return message + f"; {count} GPUs would fit (try --gpus {count} or --memory-per-gpu {math.ceil(needed / GIB)}GiB)"
