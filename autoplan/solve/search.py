"""Search over layouts: degrees, ZeRO stage, HSDP, schedule, virtual stages, micro-batch size,
recompute mode, and the stage split with recompute per module.

1. Families (tp, pp, dp_replicate, dp_shard, zero; layouts.py) whose model states alone overflow the
   memory cap are pruned with that bound.
2. Every variant (schedule, v, micro-batch, recompute) gets a step-time lower bound (perfect balance
   of the fastest module times plus the bubble); variants are priced in order of that bound, and the
   search stops once the bound exceeds the best step time found (branch and bound).
3. A priced variant whose memory lower bound (its leanest stage's, remembered per the layout's memory vectors:
   cost/evaluate.py memory_lower_bound) overflows the cap is listed with it, before its problem is built; the
   others are split by the fast packing (split.py), recompute chosen per module, and priced (evaluate.py); a
   packing that cannot reach the time that would tie the best so far stops early.
The fastest fitting layout wins, except that step times within TIE_TOLERANCE of the fastest count
as equal and the simplest of those wins (and DDP is kept unless sharding gains SHARDING_MARGIN).
The winner is then solved again as a MILP (ilp.py), warm started and bounded by its packing, so the
plan carries the MILP solver's status and gap.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from autoplan.chain.modules import ModuleChain
from autoplan.cost.context import Context, Pricing, expert_shard_degree, gib
from autoplan.cost.evaluate import (Candidate, build_problem, evaluate, host_oom_reason, memory_lower_bound,
                                    oom_reason, with_memory_without_cp_ep)
from autoplan.cost.memory import model_state_bytes
from autoplan.errors import UserError
from autoplan.hardware.types import Cluster
from autoplan.layout import RECOMPUTE, SCHEDULE_BY_NAME, SUPPORTED, Layout, Scope, compile_problems, problems
from autoplan.plan import Parallelism, SolverInfo, Training
from autoplan.profile_data import ModelProfile
from autoplan.solve import layouts
from autoplan.solve.dp import leanest_assignment, solve_dp
from autoplan.solve.ilp import solve_ilp
from autoplan.solve.ilp_backend import resolve_solver
from autoplan.solve.infeasible import infeasible_message
from autoplan.solve.parameter_server import ParameterServerLayout, parameter_server_layout
from autoplan.solve.split import Slower, greedy_split

TIE_TOLERANCE = 0.01
"""Predicted step times within 1% of the fastest are treated as equal: the cost model is not more
accurate than that, and a simpler program is worth more than the rest."""
SHARDING_MARGIN = 0.05
"""Sharded data parallelism (ZeRO/FSDP) must be this much faster than the best replicated layout to be
chosen: its gain is mostly the sharded optimizer step, while FSDP's per-module hooks and parameter
bookkeeping cost host time the model does not price."""
ILP_TIME_LIMIT_S = 10.0
"""Time limit of the MILP on the winner when the caller gives none, seconds."""
MAX_LISTED = 400
"""Candidates kept in SearchResult.candidates (all are counted in candidates_evaluated)."""


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    candidates: tuple[Candidate, ...]
    """Layouts tried, the best first, then the other fitting ones by step time, then the rest."""
    solver: SolverInfo
    chain: ModuleChain
    """The modules the stages were cut from."""
    context: Context
    """The profile priced on the cluster (its module tables cached): Context.at prices more layouts of the
    same model at other GPU counts without pricing its modules again."""
    parameter_server: ParameterServerLayout | None = None
    """The same model under a parameter server, priced to say why it lost (solve/parameter_server.py)."""


@dataclass(frozen=True)
class SearchOptions:
    """How a search prices and solves (search's options; the layout it must keep is the pins)."""

    features: frozenset[str] | None = None
    """What the layouts may use (layout.SUPPORTED by default: what the program runs; ALL_FEATURES to price others)."""
    solver: str = "highs"
    """The MILP solver of the chosen layout's stage split (solve/ilp_backend.py)."""
    time_limit_s: float | None = None
    """The MILP's time limit (ILP_TIME_LIMIT_S by default)."""
    float8_linears: str | None = None
    """A float8 recipe (cost/float8.py FLOAT8_RECIPES) to price the Linears with, priced only."""
    ring_traced: bool = False
    """Context parallelism's ring priced as traced into torch.compile graphs (Context.ring_traced), priced only."""


def search(profile: ModelProfile, cluster: Cluster, training: Training, pins: Layout = Layout(),
           options: SearchOptions = SearchOptions()) -> SearchResult:
    """The best layout of `profile` on `cluster` that keeps `pins`, and every other one tried (SearchResult)."""
    started = time.perf_counter()
    solver, time_limit_s = options.solver, options.time_limit_s
    resolve_solver(solver)
    features = SUPPORTED if options.features is None else frozenset(options.features)
    pricing = Pricing(layouts.compiled(pins, cluster, features), options.float8_linears, options.ring_traced)
    ctx = Context(profile, cluster, training, features, pricing)
    scope = layouts.scope_of(ctx)
    layouts.check_pins(pins, scope)
    explored = explore(ctx, pins)
    tried, pruned, considered = explored.tried, explored.pruned, explored.considered
    fitting = sorted((c for c in tried if c.fits), key=_by_time)
    if not fitting:
        raise infeasible_message(ctx, pins, tried + pruned)
    chosen = choose(fitting)
    best, info = refine_with_ilp(ctx, chosen, pins.recompute is not None, solver, time_limit_s)
    best = with_memory_without_cp_ep(priced_as(ctx, best), best, layouts.modes_for(
        best.parallelism.recompute, pins.recompute is not None))
    twin = compile_twin(ctx, best, pins, pins.recompute is not None, scope)
    other_split = [dataclasses.replace(c, reason=_losing_reason(c, best))
                   for c in _other_expert_split(ctx, pins, best, tried) + _schedule_rival(ctx, pins, best, tried)]
    others = [dataclasses.replace(c, reason=_losing_reason(c, best)) for c in fitting if c is not chosen] + other_split
    ranked = [best] + sorted(others + ([twin] if twin else []), key=_by_time)
    rest = sorted((c for c in tried + pruned if not c.fits), key=lambda c: c.memory_needed_bytes)
    fully_pinned = pins.dp is not None and pins.pp is not None
    info = dataclasses.replace(info, name="pinned" if fully_pinned else info.name,
                               time_s=time.perf_counter() - started, candidates_evaluated=considered)
    listed = (ranked + rest)[:MAX_LISTED]
    listed += [c for c in other_split if not any(c is x for x in listed)]  # kept for the report's experts section
    return SearchResult(best=best, candidates=tuple(listed), solver=info, chain=ctx.chain,
                        context=ctx, parameter_server=parameter_server_layout(ctx, best))


@dataclass(frozen=True)
class Work:
    """A variant of a family waiting to be priced, and the step time no split of it can beat."""

    time_bound_s: float
    family: Parallelism
    variant: layouts.Variant


@dataclass(frozen=True)
class Explored:
    """What the branch and bound over a search's layouts found."""

    tried: list[Candidate]
    """Layouts priced (fitting or not), in the order they were priced."""
    pruned: list[Candidate]
    """Families whose model states alone overflow memory, each at its leanest variant."""
    considered: int
    """Variants enumerated."""
    priced: int
    """Variants priced before the bound (or max_priced) stopped the search."""
    bounded: bool
    """max_priced stopped it: a variant left unpriced could still have won."""


def _other_expert_split(ctx: Context, pins: Layout, best: Candidate, tried: list[Candidate]) -> list[Candidate]:
    """On a model with expert layers and ep not pinned: the fastest fitting layout of the other kind than `best`'s
    (ep = 1 when it splits the experts, ep > 1 when it does not), by its own branch and bound when the search's
    cut it off before pricing one (what the report and the summary measure expert parallelism by); else []."""
    split = best.parallelism.ep > 1
    if not ctx.experts or pins.ep is not None:
        return []
    if any(c.fits and (c.parallelism.ep > 1) != split for c in tried):
        return []
    found = explore(ctx, pins, keep=lambda fam: (fam.ep > 1) != split).tried
    fitting = sorted((c for c in found if c.fits), key=_by_time)
    return fitting[:1]


def _schedule_rival(ctx: Context, pins: Layout, best: Candidate, tried: list[Candidate]) -> list[Candidate]:
    """When a zero-bubble schedule (backward split into input- and weight-gradient passes) wins and the schedule is
    not pinned: the same degrees' fastest fitting layout with a schedule that does not split backward, by its own
    branch and bound when the search's cut it off (candidates.csv's schedule_tradeoff compares the two); else []."""
    par = best.parallelism
    if pins.schedule is not None or not SCHEDULE_BY_NAME[par.schedule].split_backward:
        return []

    def same_degrees(c: Candidate) -> bool:
        q = c.parallelism
        return (q.tp, q.pp, q.dp_replicate,
                q.dp_shard, q.cp, q.ep) == (
            par.tp, par.pp, par.dp_replicate,
            par.dp_shard, par.cp, par.ep)

    def unsplit(c: Candidate) -> bool:
        return c.fits and not SCHEDULE_BY_NAME[c.parallelism.schedule].split_backward

    if any(unsplit(c) and same_degrees(c) for c in tried):
        return []
    found = []
    for name in layouts.SCHEDULE_PREFERENCE:
        if name in ctx.features and not SCHEDULE_BY_NAME[name].split_backward:
            found += explore(ctx, replace(pins, schedule=name), keep=lambda fam: (
                fam.tp, fam.pp, fam.dp_replicate, fam.dp_shard, fam.cp, fam.ep) == (
                par.tp, par.pp, par.dp_replicate,
                par.dp_shard, par.cp, par.ep)).tried
    return sorted((c for c in found if unsplit(c)), key=_by_time)[:1]


def explore(ctx: Context, pins: Layout, max_priced: int | None = None, explain: bool = True,
            keep: Callable[[Parallelism], bool] | None = None) -> Explored:
    """The branch and bound (module docstring, steps 1-3) over every layout the pins allow (the families `keep`
    accepts, when given), stopped after pricing `max_priced` variants when given (the first ones by their time
    lower bound: the same ones on any machine). Without
    `explain`, a layout that does not fit is not priced at its leanest split (what the "why not" and infeasibility
    messages show)."""
    cluster, batch = ctx.cluster, ctx.training.global_batch_size
    scope = layouts.scope_of(ctx)
    work, pruned, considered = [], [], 0
    shapes: dict[tuple[int, int, int, int], list[layouts.Variant]] = {}  # variants depend on dp, tp, pp, cp alone
    bound_of = _time_bounds(ctx, pins.recompute is not None)
    for fam in layouts.families(pins, scope):
        if keep is not None and not keep(fam):
            continue
        shape = fam.dp, fam.tp, fam.pp, fam.cp
        if shape not in shapes:
            shapes[shape] = layouts.variants(fam, pins, scope)
        found = shapes[shape]
        considered += len(found)
        bound = family_memory_bound(ctx, fam)
        if bound > cluster.usable_memory_bytes and found:
            lean = min(found, key=layouts.leanness)
            reason = (f"OOM by at least {gib(bound - cluster.usable_memory_bytes)} GiB (memory lower bound, "
                      "no split tried)")
            pruned.append(Candidate(parallelism=layouts.parallelism(fam, lean, lean.recompute), stages=(),
                                    predicted=None, fits=False, reason=reason, memory_needed_bytes=bound))
            continue
        work += [Work(bound_of(fam, var), fam, var) for var in found]
    if not work and not pruned and keep is None:
        raise UserError(_nothing_allowed(pins, scope, cluster.num_gpus, batch))
    work.sort(key=lambda w: w.time_bound_s)
    tried, best_time, priced, stopped = [], math.inf, 0, False
    for item in work:
        fam, var = item.family, item.variant
        if item.time_bound_s > best_time * (1 + TIE_TOLERANCE):
            break  # sorted by bound: nothing after this can win
        if max_priced is not None and priced >= max_priced:
            stopped = True
            break
        priced += 1
        # every rank runs m micro-batches: no step is shorter than m x its busiest rank's slot
        cutoff = best_time * (1 + TIE_TOLERANCE) / var.microbatches
        try:
            par = layouts.parallelism(fam, var, var.recompute)
            candidate = try_layout(runnable(ctx, par, pins, scope), par,
                                   layouts.modes_for(var.recompute, pins.recompute is not None), cutoff, explain)
        except Slower:
            continue  # no split within the time that would tie the best so far
        if candidate is None:
            continue  # recompute allowed but not used (the same layout as its recompute=none variant), or
            # unexplained: fits nowhere
        tried.append(candidate)
        if candidate.fits:
            best_time = min(best_time, candidate.predicted.step_time_s)
    return Explored(tried, pruned, considered, priced, stopped)


def _nothing_allowed(pins: Layout, scope, num_gpus: int, batch: int) -> str:
    """Why the pins leave no layout: the first rules the candidate families and their micro-batch
    variants broke."""
    rejected: list[str] = []
    for fam in layouts.families(pins, scope, rejected):
        layouts.variants(fam, pins, scope, rejected)
    shown = list(dict.fromkeys(rejected))[:3]
    why = "; ".join(shown) if shown else "dp must divide the batch, pp the GPU count"
    return f"no layout satisfies the pins '{pins.text()}' on {num_gpus} GPUs at global batch {batch}: {why}"


def choose(fitting: list[Candidate]) -> Candidate:
    """The simplest of the layouts within TIE_TOLERANCE of the fastest; a replicated (DDP) layout within
    SHARDING_MARGIN of a sharded winner is preferred to it."""
    fastest = fitting[0].predicted.step_time_s
    chosen = min((c for c in fitting if c.predicted.step_time_s <= fastest * (1 + TIE_TOLERANCE)), key=_simplicity)
    if not chosen.parallelism.fsdp_enabled:
        return chosen
    close = [c for c in fitting if not c.parallelism.fsdp_enabled
             and c.predicted.step_time_s <= chosen.predicted.step_time_s * (1 + SHARDING_MARGIN)]
    return min(close, key=_simplicity) if close else chosen


def runnable(ctx: Context, par: Parallelism, pins: Layout, scope: Scope) -> Context:
    """The context `par` is priced in: ctx, or ctx uncompiled when the search compiles by default (compile not
    pinned) and a layout rule refuses `par` compiled (compile=on with recompute over tensor-parallel shards in the
    ring, say), so that every layout is priced as the program would run it. `scope` is the search's
    (layouts.scope_of(ctx)); `par` comes from layouts.families and layouts.variants, which emit only layouts the
    rules accept uncompiled, so the compiled rules are the only ones left to check (layout.compile_problems)."""
    if not ctx.compiled or pins.compile is not None:
        return ctx
    if compile_problems(replace(par.layout(), compile="on"), scope):
        return ctx.compiled_as(False)
    return ctx


def priced_as(ctx: Context, candidate: Candidate) -> Context:
    """The search's context as `candidate` was priced in (compiled or not: runnable)."""
    return ctx if candidate.compile == ctx.compiled else ctx.compiled_as(candidate.compile)


def compile_twin(ctx: Context, best: Candidate, pins: Layout, pinned_recompute: bool,
                 scope: Scope) -> Candidate | None:
    """The winner priced with torch.compile the other way (same split and recompute), with why it lost: the
    compile choice shown beside the layout's (None when the features exclude compile). `scope`: the search's."""
    if "compile" not in ctx.features or best.assignment is None:
        return None
    other = ctx.compiled_as(not best.compile)
    par = best.parallelism
    refused = problems(replace(par.layout(), compile="on"), scope) if not best.compile else []
    problem = build_problem(other, par, layouts.modes_for(par.recompute, pinned_recompute))
    twin = evaluate(other, par, problem, best.assignment, problem.fits(best.assignment))
    change = (twin.predicted.step_time_s - best.predicted.step_time_s) / best.predicted.step_time_s * 100
    opening, ending = _why_compile_lost(best.compile, change, ctx.compiled, pins.compile == "off", refused)
    oom = f"; {oom_reason(twin, problem.memory_cap_bytes)}" if not twin.fits else ""
    return dataclasses.replace(twin, reason=opening + oom + ending)


def _why_compile_lost(best_compiled: bool, change_percent: float, compiled_by_default: bool, pinned_off: bool,
                      refused: list[str]) -> tuple[str, str]:
    """Why the other compile choice than the winner's lost, as (the reason's opening, its ending after any OOM
    clause): `change_percent` is the other choice's step time against the winner's, `refused` the rules the winner's
    layout breaks compiled. Compiled, the uncompiled twin is slower. Uncompiled: the program cannot run it compiled
    (the search compiles by default and a rule refuses it, search.runnable), or compile was pinned off, or it is off
    by default for CPU processes; a rule refusing the compiled twin (a zero-bubble schedule, say) is named after."""
    if best_compiled:
        return f"compile=off: {change_percent:.1f}% slower than compile=on (pointwise ops run unfused)", ""
    faster = f"compile=on: {-change_percent:.1f}% faster"
    if compiled_by_default and refused:
        return f"{faster} per step, but the program cannot run it", "".join(f": {why}" for why in refused)
    if pinned_off:
        opening = f"{faster}, but pinned off"
    else:
        opening = (f"{faster} per step, but off by default for CPU processes (inductor first compiles each distinct "
                   f"module with gcc, seconds to minutes here, more than a short run gains; pin compile=on)")
    return opening, "".join(f"; and the program cannot run it: {why}" for why in refused)


def family_memory_bound(ctx: Context, fam: Parallelism) -> float:
    """Model states of the average pipeline rank: no split of this family can do better. The expert
    parameters (E/ep per rank) shard over expert_shard_degree ranks (cost/context.py)."""
    if fam.offload:  # on the host (CPU offload)
        return 0.0
    numel = ctx.total_numel(fam.tp, fam.ep)
    experts = sum(ctx.module_expert_numel(fam.ep))
    zero = fam.zero
    expert_shard = expert_shard_degree(fam.fsdp_shard, fam.ep, fam.tp)
    states = sum(model_state_bytes(numel - experts, ctx.dtype, zero, fam.fsdp_shard).values()) + \
        sum(model_state_bytes(experts, ctx.dtype, zero, expert_shard).values())
    if fam.pp > 1 and zero >= 2:  # unreduced gradients (and unsharded FSDP parameters) under pipelining
        states += numel * (2 if zero == 3 else 1) * ctx.dtype_bytes
    return states / fam.pp


def time_lower_bound(ctx: Context, fam: Parallelism, var: layouts.Variant, pinned: bool,
                     slot: float | None = None) -> float:
    """(m + (p - 1) / v) x the slowest rank's slot if the fastest module times balanced perfectly; m slots for a
    zero-bubble schedule (its weight-gradient passes may fill the whole bubble). `slot`: _slot's, when known."""
    if slot is None:
        slot = _slot(ctx, fam, var, pinned)
    bubble = 0.0 if SCHEDULE_BY_NAME[var.schedule].split_backward else (fam.pp - 1) / var.virtual_stages
    return (var.microbatches + bubble) * slot


def _slot(ctx: Context, fam: Parallelism, var: layouts.Variant, pinned: bool) -> float:
    """A rank's time per micro-batch if the fastest module times of `fam` at `var`'s micro-batch size balanced
    perfectly over its pp ranks: read of the variant are its micro-batch size and (pinned) its recompute mode."""
    table = ctx.table(replace(fam, microbatch=var.microbatch))
    mode = "none" if not pinned else var.recompute
    return table.total_s[mode] / fam.pp


def _time_bounds(ctx: Context, pinned: bool) -> Callable[[Parallelism, layouts.Variant], float]:
    """time_lower_bound, remembered per what it reads of the family (tp, sp, cp, ep, pp) and the variant: the
    families that differ only in how data parallelism shards (replicate x shard, resharding, offload) share it,
    and a big mixture of experts enumerates hundreds of thousands of variants. The slot (the module tables' part)
    is remembered per micro-batch size and recompute mode: the variants of a size differ only in the schedule's
    arithmetic."""
    known: dict[tuple, float] = {}
    slots: dict[tuple, float] = {}

    def bound(fam: Parallelism, var: layouts.Variant) -> float:
        key = (fam.tp, fam.sp, fam.cp, fam.ep, fam.pp, var)
        if key not in known:
            at = (fam.tp, fam.sp, fam.cp, fam.ep, fam.pp, var.microbatch, var.recompute if pinned else "none")
            if at not in slots:
                slots[at] = _slot(ctx, fam, var, pinned)
            known[key] = time_lower_bound(ctx, fam, var, pinned, slots[at])
        return known[key]

    return bound


def try_layout(ctx: Context, par: Parallelism, modes: tuple[str, ...], cutoff: float = math.inf,
               explain: bool = True) -> Candidate | None:
    """`par` priced at its best split (None when a recompute mode was allowed and not used), or, when the
    packing finds no split that fits, at its leanest split: fitting if that one fits (the packing is a
    heuristic), else with the OOM reason (None without `explain`). What fits is ChainProblem.fits's to say
    (the memory the plan reports), whichever solver proposed the split."""
    cap = ctx.cluster.usable_memory_bytes
    bound = memory_lower_bound(ctx, par, modes)  # build_problem's, remembered: most variants stop here
    host = host_oom_reason(ctx, par)
    if host:
        return Candidate(parallelism=par, stages=(), predicted=None, fits=False, reason=host, memory_needed_bytes=bound)
    if bound > cap:
        reason = f"OOM by at least {gib(bound - cap)} GiB (memory lower bound, no split tried)"
        return Candidate(parallelism=par, stages=(), predicted=None, fits=False, reason=reason,
                         memory_needed_bytes=bound)
    problem = build_problem(ctx, par, modes)
    found = greedy_split(problem, modes[0] if len(modes) == 1 else None, cutoff if cutoff < math.inf else None)
    if found is not None and not problem.fits(found):
        found = None  # the packing proposes, ChainProblem.fits decides (tests/test_ilp.py holds them equal)
    if found is None:
        if not explain:
            return None
        leanest = leanest_assignment(problem)
        if leanest is None:
            return Candidate(parallelism=par, stages=(), predicted=None, fits=False,
                             reason=f"more stages than the {problem.num_modules} modules", memory_needed_bytes=bound)
        if problem.fits(leanest):
            return evaluate(ctx, par, problem, leanest, True)
        candidate = evaluate(ctx, par, problem, leanest, False)
        return dataclasses.replace(candidate, reason=oom_reason(candidate, cap))
    if len(modes) > 1 and all(k == "none" for k in found.modes):
        return None
    return evaluate(ctx, par, problem, found, True)


def refine_with_ilp(ctx: Context, candidate: Candidate, pinned: bool, solver: str,
                    time_limit_s: float | None) -> tuple[Candidate, SolverInfo]:
    """Re-solve the winner's split and recompute as a MILP, seeded and bounded by its assignment. The plan's
    SolverInfo says what the MILP reported: "optimal"; "time_limit" with the gap of the split kept (the MILP's own,
    or, without an incumbent, the seed's to the step-time lower bound); "infeasible" or "failed" (a solver failure:
    the seed fits, and the MILP's rows are ChainProblem.fits's own), the seed kept, gap to the lower bound."""
    par = candidate.parallelism
    mode = par.recompute
    ctx = priced_as(ctx, candidate)
    problem = build_problem(ctx, par, layouts.modes_for(mode, pinned))
    start = candidate.assignment
    if problem.num_stages == 1 and len(problem.modes) == 1:
        return candidate, SolverInfo(name=resolve_solver(solver), status="optimal", time_s=0.0, candidates_evaluated=1)
    if problem.virtual_stages == 1 and len(problem.modes) == 1:  # the exact DP: a tighter bound and a better start
        exact = solve_dp(problem)
        if exact is not None and exact.value < problem.bottleneck(start) * (1 - 1e-9):
            start = exact.assignment
    bound = problem.bottleneck(start)
    limit = ILP_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    result = solve_ilp(problem, solver, limit, warm_start=start, upper_bound=bound)
    info = SolverInfo(name=result.solver, status=result.status, time_s=result.time_s, candidates_evaluated=1,
                      gap=result.gap)
    if result.assignment is not None and result.assignment != candidate.assignment \
            and problem.fits(result.assignment) and result.objective <= bound * (1 + 1e-9):
        other = evaluate(ctx, par, problem, result.assignment, True)
        if other.predicted.step_time_s < candidate.predicted.step_time_s:
            candidate = other
    if result.assignment is None:  # the seed is kept: its gap to the lower bound bounds the true one
        lower = problem.time_lower_bound()
        info = dataclasses.replace(info, gap=(bound - lower) / bound if bound > 0 else 0.0)
    return candidate, info


def solver_warning(info: SolverInfo, time_limit_s: float | None) -> str:
    """The line to warn with when the MILP did not prove the plan's stage split optimal ("" when it did), naming
    what it reported (refine_with_ilp) and the time limit it ran under."""
    limit = ILP_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    within = f"its slowest rank's time within {100 * info.gap:.1f}% of the optimum's"
    if info.status == "time_limit":
        return (f"the MILP stopped at its {limit:g} s time limit (--time-limit): the stage split planned is the best "
                f"found, {within}")
    if info.status == "infeasible":
        return ("the MILP reported no stage split within the memory cap, though the packing's split fits it (a "
                f"solver failure): the plan keeps that split, {within} (--solver cbc may prove it)")
    if info.status == "failed":
        return (f"the MILP stopped without a solution or a proof (a solver failure): the plan keeps the packing's "
                f"split, {within}")
    return ""


def _by_time(c: Candidate) -> tuple:
    return (c.predicted.step_time_s, _simplicity(c))


def _simplicity(c: Candidate) -> tuple:
    par = c.parallelism
    schedule = layouts.SCHEDULE_PREFERENCE.index(par.schedule)
    recompute = RECOMPUTE.index(par.recompute)
    return (par.offload, par.pp, par.tp,
            par.cp, par.ep,
            par.zero, par.fsdp_shard > 1 and par.dp_replicate > 1, schedule,
            par.virtual_stages, recompute, _partial_recompute(c),
            c.predicted.step_time_s, -par.microbatch, par.dp)


def _partial_recompute(c: Candidate) -> int:
    """Modules recomputed when only some are (recomputing all of them is one switch: as simple as none)."""
    recomputed = len(c.activation_checkpoint_modules)
    return 0 if recomputed == sum(len(s.modules) for s in c.stages) else recomputed


def _losing_reason(c: Candidate, best: Candidate) -> str:
    percent = (c.predicted.step_time_s - best.predicted.step_time_s) / best.predicted.step_time_s * 100
    if percent < 0 and c.parallelism.fsdp_enabled and not best.parallelism.fsdp_enabled:
        return (f"{-percent:.1f}% faster, but shards the model states: DDP is kept within "
                f"{SHARDING_MARGIN:.0%} (FSDP hooks and bookkeeping are not priced)")
    if abs(percent) <= TIE_TOLERANCE * 100:  # a faster one in the tie lost to the simpler best
        return f"{percent:+.2f}% step time vs the best, a tie within {TIE_TOLERANCE:.0%}: the best is simpler"
    digits = 0 if percent >= 1 else 1
    offloads = c.parallelism.offload and not best.parallelism.offload
    why = " (CPU offload: host-device copies and the optimizer step on the CPU)" if offloads else ""
    return f"{percent:.{digits}f}% slower than the best{why}"
