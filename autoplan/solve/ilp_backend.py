"""MILP solver back ends through PuLP: HiGHS (highspy, else the HiGHS binary), CBC as the fallback.

PuLP reports LpStatus "Optimal" even after a time limit; the solution status (prob.sol_status)
tells an optimum from an incumbent. HiGHS gets the warm start through highspy's setSolution.
Every back end is silent: msg=False sends the command-line solvers' output to os.devnull, and the
banner highspy prints from C when a Highs object is created (before PuLP can set output_flag) goes to
os.devnull through file descriptor 1 (see quiet_stdout).
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import warnings
from contextlib import contextmanager
from functools import cache

import pulp

from autoplan.errors import UserError

SOLVERS = ("highs", "cbc")


class HighsWithStart(pulp.HiGHS):
    """PuLP's highspy interface, plus the variables' initial values handed to HiGHS as a start."""

    def __init__(self, warm_start: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.use_start = warm_start

    def createAndConfigureSolver(self, lp):
        with quiet_stdout():
            super().createAndConfigureSolver(lp)

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


@cache
def _c_library():
    """This process's C library (for fflush), or None where ctypes has no handle to it (Windows)."""
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):
        return None


@contextmanager
def quiet_stdout():
    """Point file descriptor 1 at os.devnull for the block: C code (the HiGHS banner "Running HiGHS ...
    Copyright ...") writes there directly, past sys.stdout. The C library's buffered output is flushed
    before fd 1 is restored, so nothing from the block reaches the real stdout later."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 (a closed stdout): nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        if _c_library() is not None:
            _c_library().fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def resolve_solver(solver: str) -> str:
    """The solver that will run for `solver`: "highs" when HiGHS is usable, else "cbc"."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r} (choose one of: {', '.join(SOLVERS)})")
    return choose_backend(solver, None, False)[1]


def choose_backend(solver: str, time_limit_s: float | None, warm: bool):
    """highs: highspy through PuLP if importable, else the HiGHS_CMD binary, else CBC."""
    if solver == "highs":
        if pulp.HiGHS().available():
            return HighsWithStart(warm, msg=False, timeLimit=time_limit_s), "highs"
        command = pulp.HiGHS_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm)
        if command.available():
            return command, "highs"
    if pulp.COIN_CMD(msg=False).available():
        return pulp.COIN_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm), "cbc"
    with warnings.catch_warnings():  # PuLP 3.x marks its bundled CBC deprecated; it is still the fallback
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm), "cbc"


def solver_status(prob: pulp.LpProblem, time_limit_s: float | None) -> str:
    """What the solve of `prob` ended in, read from PuLP's solution status (prob.sol_status: its LpStatus says
    "Optimal" after a time limit too): "optimal", "time_limit" (an incumbent, or none found in time), "infeasible"
    (proved) or "failed" (no solution and no proof: a solver error, or unbounded). Without a solution, highspy
    tells a time limit from an error; the command-line solvers do not, so there the time limit is taken to
    have stopped them when one was set."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit"  # the only limit set (HiGHS also stops so at an objective bound: none is set)
    if prob.sol_status == pulp.LpSolutionInfeasible or prob.status == pulp.LpStatusInfeasible:
        return "infeasible"  # CBC's "Integer infeasible" leaves the solution status at "no solution found"
    if prob.sol_status == pulp.LpSolutionNoSolutionFound and time_limit_s is not None:
        model_status = getattr(getattr(prob, "solverModel", None), "getModelStatus", None)
        if model_status is None:
            return "time_limit"
        import highspy  # a highspy model answered: importable

        return "time_limit" if model_status() == highspy.HighsModelStatus.kTimeLimit else "failed"
    return "failed"


def mip_gap(prob: pulp.LpProblem, objective: float, lower_bound: float) -> float:
    """HiGHS's MIP gap when it has one, else the gap to `lower_bound` (CBC reports none)."""
    info = getattr(getattr(prob, "solverModel", None), "getInfo", None)
    if info is not None and math.isfinite(info().mip_gap):
        return float(info().mip_gap)
    return (objective - lower_bound) / objective if objective > 0 else 0.0
