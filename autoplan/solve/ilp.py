"""Stage split and per-module recompute as a mixed-integer program (PuLP; HiGHS, or CBC).

Identical layers are tied: the chain is cut into runs r = 0..R-1 of consecutive identical modules
(ChainProblem.runs; tied-parameter modules stand alone), run r holding L_r modules. Stages s = 0..S-1
(S = p v), stage s on rank q(s) = s mod p; recompute modes k; tied groups g; largest terms j.
Data: t_rk time per micro-batch of a module of run r in mode k; from the memory model of stage s
(cost/memory.py): a_srk linear bytes of a module (states + activations in mode k), G_sg tied-group
bytes, V_jr largest-term bytes, c_sr bytes kept when s ends inside run r (the run's largest boundary);
o_s constant stage time (sends); C the memory cap.

    minimize    T
    n_rsk in {0..L_r}   modules of run r on stage s in mode k        b_rs in {0,1}  s holds some of r
    c_rs >= 0           modules of run r on stages <= s (cumulative)  e_rs in [0,1]  s ends inside r
    y_gs in [0,1]       s holds tied group g                        M_jq >= 0      largest term on rank q

    assignment  sum_{s,k} n_rsk = L_r                                                  for all r
    linking     b_rs <= sum_k n_rsk <= L_r b_rs;   sum_r b_rs >= 1 (no empty stage)      for all r, s
    cumulative  c_rs = c_r(s-1) + sum_k n_rsk                                            for all r, s
    order       c_rs >= L_r b_(r+1)s    (a stage touching run r+1 comes after all of run r)
                c_(r+1)(s-1) <= L_(r+1) (1 - b_rs)   (and before any of run r+1)          for r < R-1, s
    bottleneck  sum_{s: q(s)=q} (sum_{r,k} t_rk n_rsk + o_s) <= T                         for all q
    memory      sum_{s: q(s)=q} (sum_{r,k} a_srk n_rsk + sum_g G_sg y_gs + sum_r c_sr e_rs)
                + sum_j M_jq <= C                                                         for all q
                y_gs >= b_rs (r holds a module of g),  M_jq >= V_jr b_rs (q(s) = q),
                e_rs >= b_rs - b_(r+1)s (r < R-1),  e_(R-1)s >= b_(R-1)s (s < S-1)

Order on adjacent runs implies it for all pairs, so every stage holds a contiguous slice and stages
follow the chain. y, M and e only make the memory rows harder, so at a solution they may sit at their
lower bounds: the rows then say "memory of rank q <= C" exactly as ChainProblem.fits computes it (runs break where a
module's times or memory terms differ, its outgoing boundary bytes included, and C carries the same
MEMORY_TOLERANCE), so the MILP and the packing agree on what fits. With every run of length 1 this is exactly the module-level model.
Each family is built by the function of the same name below. The fast packing (split.py) or the exact
DP (dp.py) supplies a warm start and an upper bound on T.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from autoplan.cost.problem import Assignment, ChainProblem, Split
from autoplan.solve.ilp_backend import choose_backend, mip_gap, resolve_solver, solver_status


@dataclass
class IlpVariables:
    """The decision variables of one ChainProblem."""

    runs: list[tuple[int, int]]
    n: dict[tuple[int, int, str], pulp.LpVariable]
    """n[r, s, k]: modules of run r on stage s in mode k."""
    b: dict[tuple[int, int], pulp.LpVariable]
    c: dict[tuple[int, int], pulp.LpVariable]
    e: dict[tuple[int, int], pulp.LpVariable]
    y: dict[tuple[int, int], pulp.LpVariable]
    M: dict[tuple[int, int], pulp.LpVariable]
    T: pulp.LpVariable
    """Slowest rank's time per micro-batch, seconds."""


@dataclass(frozen=True)
class IlpResult:
    assignment: Assignment | None
    """The best assignment found, None if none (infeasible, or a time limit before any solution)."""
    objective: float | None
    """Slowest rank time of `assignment`, seconds."""
    status: str
    """What the solver reported (solver_status): "optimal"; "time_limit" (stopped by the time limit, with the best
    assignment found or none; see gap); "infeasible" (proved that no assignment fits); "failed" (stopped without a
    solution or a proof, e.g. a solver error)."""
    gap: float
    """Relative MIP gap when stopped by the time limit with an assignment (0 when optimal, 1 without one)."""
    solver: str
    """"highs" or "cbc": the solver that ran."""
    backend: str
    """PuLP solver class used: "HiGHS" (highspy), "HiGHS_CMD", "COIN_CMD" or "PULP_CBC_CMD"."""
    time_s: float

    @property
    def split(self) -> Split | None:
        return self.assignment.split if self.assignment else None


def make_variables(prob: pulp.LpProblem, problem: ChainProblem) -> IlpVariables:
    runs = problem.runs()
    S, model = problem.num_stages, problem.memory[0]
    var = prob.add_variable
    n = {}
    for r, (a, z) in enumerate(runs):
        for s in range(S):
            for k in problem.modes:
                n[r, s, k] = var(f"n_{r}_{s}_{k}", 0, z - a, cat=pulp.LpInteger if z - a > 1 else pulp.LpBinary)
    return IlpVariables(
        runs=runs,
        n=n,
        b={(r, s): var(f"b_{r}_{s}", cat=pulp.LpBinary) for r in range(len(runs)) for s in range(S)},
        c={(r, s): var(f"c_{r}_{s}", 0) for r in range(len(runs)) for s in range(S)},
        e={(r, s): var(f"e_{r}_{s}", 0, 1) for r in range(len(runs)) for s in range(S)},
        y={(g, s): var(f"y_{g}_{s}", 0, 1) for g in range(len(model.tied_group_modules)) for s in range(S)},
        M={(j, q): var(f"M_{j}_{q}", 0) for j in range(len(model.max_vectors)) for q in range(problem.ranks)},
        T=var("T", lowBound=problem.time_lower_bound()),
    )


def _modules_on(v: IlpVariables, problem: ChainProblem, r: int, s: int):
    return pulp.lpSum(v.n[r, s, k] for k in problem.modes)


def assignment(prob, v: IlpVariables, problem: ChainProblem) -> None:
    for r, (a, z) in enumerate(v.runs):
        prob += pulp.lpSum(_modules_on(v, problem, r, s) for s in range(problem.num_stages)) == z - a, f"assign_{r}"


def linking(prob, v: IlpVariables, problem: ChainProblem) -> None:
    for s in range(problem.num_stages):
        for r, (a, z) in enumerate(v.runs):
            held = _modules_on(v, problem, r, s)
            prob += held <= (z - a) * v.b[r, s], f"link_up_{r}_{s}"
            prob += held >= v.b[r, s], f"link_down_{r}_{s}"
        prob += pulp.lpSum(v.b[r, s] for r in range(len(v.runs))) >= 1, f"nonempty_{s}"


def cumulative(prob, v: IlpVariables, problem: ChainProblem) -> None:
    for r in range(len(v.runs)):
        for s in range(problem.num_stages):
            before = v.c[r, s - 1] if s > 0 else 0
            prob += v.c[r, s] == before + _modules_on(v, problem, r, s), f"cumulative_{r}_{s}"


def order(prob, v: IlpVariables, problem: ChainProblem) -> None:
    for r in range(len(v.runs) - 1):
        length, following = v.runs[r][1] - v.runs[r][0], v.runs[r + 1][1] - v.runs[r + 1][0]
        for s in range(problem.num_stages):
            prob += v.c[r, s] >= length * v.b[r + 1, s], f"after_{r}_{s}"
            if s > 0:
                prob += v.c[r + 1, s - 1] <= following * (1 - v.b[r, s]), f"before_{r}_{s}"


def bottleneck(prob, v: IlpVariables, problem: ChainProblem) -> None:
    for q in range(problem.ranks):
        work = pulp.lpSum(problem.module_time_s[k][a] * v.n[r, s, k] for s in problem.stages_of_rank(q)
                          for r, (a, _) in enumerate(v.runs) for k in problem.modes)
        overhead = sum(problem.overhead(s) for s in problem.stages_of_rank(q))
        prob += work + overhead <= v.T, f"bottleneck_{q}"


def memory(prob, v: IlpVariables, problem: ChainProblem) -> None:
    S, n_modules = problem.num_stages, problem.num_modules
    for q in range(problem.ranks):
        used = []
        for s in problem.stages_of_rank(q):
            model = problem.memory[s]
            states, cuts = model.state_bytes, model.cut_bytes
            for r, (a, z) in enumerate(v.runs):
                for k in problem.modes:
                    used.append((states[a] + model.activations[k][a]) * v.n[r, s, k])
                for j, vec in enumerate(model.max_vectors):
                    if vec[a] > 0:
                        prob += v.M[j, q] >= vec[a] * v.b[r, s], f"largest_{j}_{r}_{s}"
                boundary = max((cuts[u] for u in range(a, min(z, n_modules - 1))), default=0.0)
                if boundary > 0 and (r < len(v.runs) - 1 or s < S - 1):
                    used.append(boundary * v.e[r, s])
                    later = v.b[r + 1, s] if r < len(v.runs) - 1 else 0
                    prob += v.e[r, s] >= v.b[r, s] - later, f"ends_{r}_{s}"
            for g, modules in enumerate(model.tied_group_modules):
                if model.group_bytes[g]:
                    used.append(model.group_bytes[g] * v.y[g, s])
                for r, (a, z) in enumerate(v.runs):
                    if any(a <= u < z for u in modules):
                        prob += v.y[g, s] >= v.b[r, s], f"tied_{g}_{r}_{s}"
        largest = pulp.lpSum(v.M[j, q] for j in range(len(problem.memory[0].max_vectors)))
        prob += pulp.lpSum(used) + largest <= problem.memory_limit_bytes, f"memory_{q}"


def build_model(problem: ChainProblem, upper_bound: float | None = None) -> tuple[pulp.LpProblem, IlpVariables]:
    prob = pulp.LpProblem("stage_split", pulp.LpMinimize)
    v = make_variables(prob, problem)
    prob += v.T
    for family in (assignment, linking, cumulative, order, bottleneck, memory):
        family(prob, v, problem)
    if upper_bound is not None:
        prob += v.T <= upper_bound * (1 + 1e-9), "upper_bound"
    return prob, v


def solve_ilp(problem: ChainProblem, solver: str = "highs", time_limit_s: float | None = None,
              warm_start: Assignment | None = None, upper_bound: float | None = None) -> IlpResult:
    """Solve the split and recompute modes. `warm_start` (e.g. the packing's assignment) seeds the
    solver; `upper_bound` caps T (its bottleneck), which only prunes the search."""
    resolve_solver(solver)
    started = time.perf_counter()
    if problem.num_stages > problem.num_modules:
        return IlpResult(assignment=None, objective=None, status="infeasible", gap=0.0, solver=solver, backend="none",
                         time_s=0.0)
    prob, v = build_model(problem, upper_bound)
    if warm_start is not None:
        _set_initial_values(v, problem, warm_start)
    backend, name = choose_backend(solver, time_limit_s, warm_start is not None)
    prob.solve(backend)
    elapsed = time.perf_counter() - started
    status = solver_status(prob, time_limit_s)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return IlpResult(assignment=None, objective=None, status=status, gap=1.0 if status == "time_limit" else 0.0,
                         solver=name, backend=backend.name, time_s=elapsed)
    found = _read_assignment(v, problem)
    objective = problem.bottleneck(found)
    if status == "optimal":
        return IlpResult(assignment=found, objective=objective, status="optimal", gap=0.0, solver=name,
                         backend=backend.name, time_s=elapsed)
    gap = mip_gap(prob, objective, problem.time_lower_bound())
    return IlpResult(assignment=found, objective=objective, status="time_limit", gap=gap, solver=name,
                    backend=backend.name, time_s=elapsed)


def _read_assignment(v: IlpVariables, problem: ChainProblem) -> Assignment:
    stage_of_module: list[int] = []
    modes: list[str] = []
    for r, (a, z) in enumerate(v.runs):
        for s in range(problem.num_stages):
            for k in problem.modes:
                count = round(v.n[r, s, k].value() or 0.0)
                stage_of_module += [s] * count
                modes += [k] * count
    assert len(stage_of_module) == problem.num_modules and stage_of_module == sorted(stage_of_module)
    return Assignment(Split.from_stage_of_module(stage_of_module), tuple(modes))


def _set_initial_values(v: IlpVariables, problem: ChainProblem, start: Assignment) -> None:
    ranges = start.split.ranges()
    S = problem.num_stages
    for r, (a, z) in enumerate(v.runs):
        running = 0
        for s, (lo, hi) in enumerate(ranges):
            held = [u for u in range(max(a, lo), min(z, hi))]
            for k in problem.modes:
                v.n[r, s, k].setInitialValue(sum(1 for u in held if start.modes[u] == k))
            v.b[r, s].setInitialValue(1 if held else 0)
            running += len(held)
            v.c[r, s].setInitialValue(running)
            ends_here = bool(held) and hi <= z and s < S - 1
            v.e[r, s].setInitialValue(1 if ends_here else 0)
    for g, modules in enumerate(problem.memory[0].tied_group_modules):
        for s, (lo, hi) in enumerate(ranges):
            v.y[g, s].setInitialValue(1 if any(lo <= u < hi for u in modules) else 0)
    for q in range(problem.ranks):
        for j in range(len(problem.memory[0].max_vectors)):
            v.M[j, q].setInitialValue(max(problem.memory[s].max_vectors[j][u] for s in problem.stages_of_rank(q)
                                          for u in range(*ranges[s])))
    v.T.setInitialValue(max(problem.time_lower_bound(), problem.bottleneck(start)))
