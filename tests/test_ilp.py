"""Stage split: MILP (HiGHS and CBC) == exact DP == brute force on random small chains."""

import itertools
import random

import pytest

from autoplan.cost.memory import StageMemoryModel
from autoplan.errors import UserError
from autoplan.solve.dp import min_peak_memory_split, solve_dp
from autoplan.solve.ilp import solve_ilp
from autoplan.solve.problem import ChainProblem, Split


def _random_problem(rng: random.Random, n: int, p: int) -> ChainProblem:
    groups = []
    if n >= 3 and rng.random() < 0.6:
        groups.append(tuple(sorted(rng.sample(range(n), 2))))
    group_bytes = tuple(float(rng.randint(1, 6)) for _ in groups)
    models = []
    base = [float(rng.randint(1, 9)) for _ in range(n)]
    activations = [float(rng.randint(0, 4)) for _ in range(n)]
    largest = tuple(float(rng.randint(0, 5)) for _ in range(n))
    cuts = tuple(float(rng.randint(0, 3)) for _ in range(n - 1))
    for s in range(p):
        in_flight = p - s  # memory depends on the stage index, as with 1F1B
        models.append(StageMemoryModel(
            stage_index=s,
            per_unit={"states": tuple(base), "activations": tuple(a * in_flight for a in activations)},
            per_tied_group={"states": group_bytes},
            tied_group_units=tuple(groups),
            largest_unit={"buffers": largest},
            outgoing_cut={"activations": tuple(c * in_flight for c in cuts)},
        ))
    times = tuple(round(rng.uniform(0.1, 5.0), 3) for _ in range(n))
    total = models[0].total(0, n)
    cap = rng.uniform(0.15, 0.9) * total  # some instances fit, some do not
    return ChainProblem(times, tuple(models), cap)


def _all_splits(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield Split((0, *cuts, n))


def _brute_force(problem: ChainProblem):
    fitting = [problem.bottleneck(s) for s in _all_splits(problem.num_units, problem.num_stages) if problem.fits(s)]
    return min(fitting) if fitting else None


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 8)
        p = rng.randint(1, min(4, n))
        yield _random_problem(rng, n, p)


CASES = list(_cases(40, seed=7))


def test_the_random_cases_include_infeasible_ones():
    outcomes = [_brute_force(problem) is None for problem in CASES]
    assert any(outcomes) and not all(outcomes)


@pytest.mark.parametrize("problem", CASES)
def test_dp_equals_brute_force(problem):
    expected = _brute_force(problem)
    found = solve_dp(problem)
    if expected is None:
        assert found is None
    else:
        assert found.value == pytest.approx(expected)
        assert problem.fits(found.split) and problem.bottleneck(found.split) == pytest.approx(expected)


@pytest.mark.parametrize("problem", CASES)
def test_highs_milp_equals_brute_force(problem):
    expected = _brute_force(problem)
    result = solve_ilp(problem, solver="highs")
    assert result.solver == "highs"
    if expected is None:
        assert result.status == "infeasible" and result.split is None
    else:
        assert result.status == "optimal" and result.gap == 0.0
        assert problem.fits(result.split) and result.objective == pytest.approx(expected)


@pytest.mark.parametrize("problem", CASES[:12])
def test_cbc_milp_equals_brute_force(problem):
    expected = _brute_force(problem)
    result = solve_ilp(problem, solver="cbc")
    assert result.solver == "cbc"
    if expected is None:
        assert result.status == "infeasible"
    else:
        assert result.status == "optimal" and result.objective == pytest.approx(expected)


@pytest.mark.parametrize("problem", [c for c in CASES if _brute_force(c) is not None][:8])
def test_warm_start_and_dp_bound_keep_the_optimum(problem):
    start = solve_dp(problem)
    result = solve_ilp(problem, warm_start=start.split, upper_bound=start.value, time_limit_s=30.0)
    assert result.status == "optimal" and result.objective == pytest.approx(start.value)


@pytest.mark.parametrize("problem", CASES[:20])
def test_min_peak_memory_split_is_the_leanest(problem):
    splits = list(_all_splits(problem.num_units, problem.num_stages))
    leanest = min(max(problem.peak_memory(s)) for s in splits)
    assert min_peak_memory_split(problem).value == pytest.approx(leanest)


def test_memory_lower_bound_never_exceeds_the_leanest_split():
    for problem in CASES:
        leanest = min(max(problem.peak_memory(s)) for s in _all_splits(problem.num_units, problem.num_stages))
        assert problem.memory_lower_bound() <= leanest + 1e-9


def test_more_stages_than_units_is_infeasible_and_unknown_solvers_are_refused():
    problem = CASES[0]
    crowded = ChainProblem(problem.unit_time_s, problem.memory * (problem.num_units + 1), problem.memory_cap_bytes)
    assert solve_dp(crowded) is None and solve_ilp(crowded).status == "infeasible"
    with pytest.raises(UserError, match="gurobi"):
        solve_ilp(problem, solver="gurobi")


def test_a_time_limit_reports_the_incumbent_and_a_finite_gap():
    rng = random.Random(3)
    large = _random_problem(rng, 60, 12)
    large = ChainProblem(large.unit_time_s, large.memory, large.memory_cap_bytes * 100)
    start = solve_dp(large)
    result = solve_ilp(large, time_limit_s=0.0, warm_start=start.split)
    assert result.status == "time_limit" and 0.0 <= result.gap < 1.0
    assert result.objective == pytest.approx(start.value)
    unseeded = solve_ilp(large, time_limit_s=0.0)
    assert unseeded.status == "time_limit" and unseeded.split is None
