"""MILP solver back ends through PuLP: HiGHS (highspy, else the HiGHS binary), CBC as the fallback.

PuLP reports LpStatus "Optimal" even after a time limit; the solution status (prob.sol_status)
tells an optimum from an incumbent. HiGHS gets the warm start through highspy's setSolution.
"""

from __future__ import annotations

import math
import warnings

import pulp

from autoplan.errors import UserError

SOLVERS = ("highs", "cbc")


class HighsWithStart(pulp.HiGHS):
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


def mip_gap(prob: pulp.LpProblem, objective: float, lower_bound: float) -> float:
    """HiGHS's MIP gap when it has one, else the gap to `lower_bound` (CBC reports none)."""
    info = getattr(getattr(prob, "solverModel", None), "getInfo", None)
    if info is not None and math.isfinite(info().mip_gap):
        return float(info().mip_gap)
    return (objective - lower_bound) / objective if objective > 0 else 0.0
