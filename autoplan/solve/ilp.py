"""Stage split as a mixed-integer program (PuLP; HiGHS by default, CBC as the fallback).

Units u = 0..n-1 (the chain), stages s = 0..p-1, tied groups g, largest-unit terms k.
Data: t_u time of unit u per micro-batch; a_su, G_sg, V_sku, c_su the memory model of stage s
(linear bytes, tied-group bytes, largest-unit bytes, bytes kept when s ends after u; cost/memory.py);
C the memory cap.

    minimize    T
    x_us in {0,1}     unit u runs on stage s
    y_gs in [0,1]     stage s holds tied group g            M_ks >= 0   largest term k on stage s
    e_us in [0,1]     stage s ends after unit u (u < n-1)   T >= 0      slowest stage time

    assignment   sum_s x_us = 1                                               for all u
    contiguity   x_00 = 1,  x_(n-1)(p-1) = 1,  x_(u+1)s <= x_us + x_u(s-1)       for all u < n-1, s
                 (a unit's stage is its predecessor's or the next one: contiguous, none empty)
    bottleneck   sum_u t_u x_us <= T                                          for all s
    memory       sum_u a_su x_us + sum_g G_sg y_gs + sum_k M_ks + sum_u c_su e_us <= C   for all s
                 y_gs >= x_us (u in g),  M_ks >= V_sku x_us,  e_us >= x_us - x_(u+1)s

y, M and e only make the memory rows harder, so at any solution they may sit at their lower bounds:
the rows then say exactly "memory of stage s <= C" as cost/memory.py computes it.
Each family is built by the function of the same name below. The exact DP (dp.py) supplies a
warm start and an upper bound on T.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import pulp

from autoplan.errors import UserError
from autoplan.solve.problem import ChainProblem, Split

SOLVERS = ("highs", "cbc")


@dataclass
class IlpVariables:
    """The decision variables of one ChainProblem."""

    x: dict[tuple[int, int], pulp.LpVariable]
    """x[u, s]: unit u on stage s."""
    T: pulp.LpVariable
    """Slowest stage's time per micro-batch, seconds."""
    y: dict[tuple[int, int], pulp.LpVariable]
    """y[g, s]: stage s holds tied group g."""
    M: dict[tuple[int, int], pulp.LpVariable]
    """M[k, s]: largest-unit term k on stage s, bytes."""
    e: dict[tuple[int, int], pulp.LpVariable]
    """e[u, s]: stage s ends after unit u."""


@dataclass(frozen=True)
class IlpResult:
    split: Split | None
    """The best split found, None if none (infeasible, or a time limit before any solution)."""
    objective: float | None
    """Slowest stage time of `split`, seconds."""
    status: str
    """"optimal", "time_limit" (best found; see gap) or "infeasible"."""
    gap: float
    """Relative MIP gap when stopped by the time limit (0 when optimal)."""
    solver: str
    """"highs" or "cbc": the solver that ran."""
    backend: str
    """PuLP solver class used: "HiGHS" (highspy), "HiGHS_CMD", "COIN_CMD" or "PULP_CBC_CMD"."""
    time_s: float


def make_variables(prob: pulp.LpProblem, problem: ChainProblem) -> IlpVariables:
    n, p = problem.num_units, problem.num_stages
    model = problem.memory[0]
    var = prob.add_variable
    return IlpVariables(
        x={(u, s): var(f"x_{u}_{s}", cat=pulp.LpBinary) for u in range(n) for s in range(p)},
        T=var("T", lowBound=problem.time_lower_bound()),
        y={(g, s): var(f"y_{g}_{s}", 0, 1) for g in range(len(model.tied_group_units)) for s in range(p)},
        M={(k, s): var(f"M_{k}_{s}", 0) for k in range(len(model.max_vectors)) for s in range(p)},
        e={(u, s): var(f"e_{u}_{s}", 0, 1) for u in range(n - 1) for s in range(p)},
    )


def assignment(prob: pulp.LpProblem, v: IlpVariables, problem: ChainProblem) -> None:
    for u in range(problem.num_units):
        prob += pulp.lpSum(v.x[u, s] for s in range(problem.num_stages)) == 1, f"assign_{u}"


def contiguity(prob: pulp.LpProblem, v: IlpVariables, problem: ChainProblem) -> None:
    n, p = problem.num_units, problem.num_stages
    prob += v.x[0, 0] == 1, "first_unit_on_first_stage"
    prob += v.x[n - 1, p - 1] == 1, "last_unit_on_last_stage"
    for u in range(n - 1):
        for s in range(p):
            previous = v.x[u, s - 1] if s > 0 else 0
            prob += v.x[u + 1, s] <= v.x[u, s] + previous, f"contiguous_{u}_{s}"


def bottleneck(prob: pulp.LpProblem, v: IlpVariables, problem: ChainProblem) -> None:
    for s in range(problem.num_stages):
        work = pulp.lpSum(t * v.x[u, s] for u, t in enumerate(problem.unit_time_s))
        prob += work <= v.T, f"bottleneck_{s}"


def memory(prob: pulp.LpProblem, v: IlpVariables, problem: ChainProblem) -> None:
    n = problem.num_units
    for s, model in enumerate(problem.memory):
        for g, units in enumerate(model.tied_group_units):
            for u in units:
                prob += v.y[g, s] >= v.x[u, s], f"tied_{g}_{u}_{s}"
        for k, vec in enumerate(model.max_vectors):
            for u in range(n):
                if vec[u] > 0:
                    prob += v.M[k, s] >= vec[u] * v.x[u, s], f"largest_{k}_{u}_{s}"
        for u in range(n - 1):
            prob += v.e[u, s] >= v.x[u, s] - v.x[u + 1, s], f"ends_{u}_{s}"
        used = (pulp.lpSum(b * v.x[u, s] for u, b in enumerate(model.unit_bytes) if b)
                + pulp.lpSum(b * v.y[g, s] for g, b in enumerate(model.group_bytes) if b)
                + pulp.lpSum(v.M[k, s] for k in range(len(model.max_vectors)))
                + pulp.lpSum(b * v.e[u, s] for u, b in enumerate(model.cut_bytes) if b))
        prob += used <= problem.memory_cap_bytes, f"memory_{s}"


def build_model(problem: ChainProblem, upper_bound: float | None = None) -> tuple[pulp.LpProblem, IlpVariables]:
    prob = pulp.LpProblem("stage_split", pulp.LpMinimize)
    v = make_variables(prob, problem)
    prob += v.T
    assignment(prob, v, problem)
    contiguity(prob, v, problem)
    bottleneck(prob, v, problem)
    memory(prob, v, problem)
    if upper_bound is not None:
        prob += v.T <= upper_bound * (1 + 1e-9), "upper_bound"
    return prob, v


def solve_ilp(problem: ChainProblem, solver: str = "highs", time_limit_s: float | None = None,
              warm_start: Split | None = None, upper_bound: float | None = None) -> IlpResult:
    """Solve the stage split. `warm_start` (e.g. the DP's split) seeds the solver; `upper_bound`
    caps T (the DP's optimum), which only prunes the search."""
    resolve_solver(solver)
    started = time.perf_counter()
    n, p = problem.num_units, problem.num_stages
    if p > n:
        return IlpResult(None, None, "infeasible", 0.0, solver, "none", 0.0)
    prob, v = build_model(problem, upper_bound)
    if warm_start is not None:
        _set_initial_values(v, problem, warm_start)
    backend, name = _choose_backend(solver, time_limit_s, warm_start is not None)
    prob.solve(backend)
    elapsed = time.perf_counter() - started
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        stopped = time_limit_s is not None and prob.sol_status == pulp.LpSolutionNoSolutionFound
        status = "time_limit" if stopped else "infeasible"
        return IlpResult(None, None, status, 1.0 if status == "time_limit" else 0.0, name, backend.name, elapsed)
    stage_of_unit = [max(range(p), key=lambda s: v.x[u, s].value() or 0.0) for u in range(n)]
    split = Split.from_stage_of_unit(stage_of_unit)
    objective = problem.bottleneck(split)
    if prob.sol_status == pulp.LpSolutionOptimal:
        return IlpResult(split, objective, "optimal", 0.0, name, backend.name, elapsed)
    return IlpResult(split, objective, "time_limit", _gap(prob, problem, objective), name, backend.name, elapsed)


def _gap(prob: pulp.LpProblem, problem: ChainProblem, objective: float) -> float:
    """HiGHS's MIP gap when it has one, else the gap to ChainProblem.time_lower_bound."""
    info = getattr(getattr(prob, "solverModel", None), "getInfo", None)
    if info is not None and math.isfinite(info().mip_gap):
        return float(info().mip_gap)
    bound = problem.time_lower_bound()  # HiGHS had no dual bound yet, or CBC (which does not report one)
    return (objective - bound) / objective if objective > 0 else 0.0


def _set_initial_values(v: IlpVariables, problem: ChainProblem, split: Split) -> None:
    for s, (a, b) in enumerate(split.ranges()):
        for u in range(problem.num_units):
            v.x[u, s].setInitialValue(1 if a <= u < b else 0)
        for g, units in enumerate(problem.memory[s].tied_group_units):
            v.y[g, s].setInitialValue(1 if any(a <= u < b for u in units) else 0)
        for k, vec in enumerate(problem.memory[s].max_vectors):
            v.M[k, s].setInitialValue(max(vec[a:b]))
        for u in range(problem.num_units - 1):
            v.e[u, s].setInitialValue(1 if u == b - 1 else 0)
    v.T.setInitialValue(max(problem.time_lower_bound(), problem.bottleneck(split)))


class _HighsWithStart(pulp.HiGHS):
    """PuLP's highspy interface, plus the variables' initial values handed to HiGHS as a start."""

    def __init__(self, warm_start: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.use_start = warm_start

    def callSolver(self, lp):
        if self.use_start:
            import highspy  # importable whenever this class is chosen (pulp.HiGHS().available())

            start = highspy.HighsSolution()
            values = [0.0] * len(lp.variables())
            for var in lp.variables():
                values[var.index] = var.varValue or 0.0
            start.col_value = values
            start.value_valid = True
            lp.solverModel.setSolution(start)
        lp.solverModel.run()


def resolve_solver(solver: str) -> str:
    """The solver that will run for `solver`: "highs" when HiGHS is usable, else "cbc"."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r} (choose one of: {', '.join(SOLVERS)})")
    return _choose_backend(solver, None, False)[1]


def _choose_backend(solver: str, time_limit_s: float | None, warm: bool):
    """highs: highspy through PuLP if importable, else the HiGHS_CMD binary, else CBC."""
    if solver == "highs":
        if pulp.HiGHS().available():
            return _HighsWithStart(warm, msg=False, timeLimit=time_limit_s), "highs"
        command = pulp.HiGHS_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm)
        if command.available():
            return command, "highs"
    if pulp.COIN_CMD(msg=False).available():
        return pulp.COIN_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm), "cbc"
    with warnings.catch_warnings():  # PuLP 3.x marks its bundled CBC deprecated; it is still the fallback
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm), "cbc"
