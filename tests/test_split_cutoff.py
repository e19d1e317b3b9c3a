"""The packing's early exits under a cutoff (the branch and bound's "can this layout still tie the best?") change
nothing: the time-alone check (split._reaches_end_in_time) never refutes a limit the memory-aware packing meets,
and greedy_split with a cutoff returns what packing every limit it tries would (the same split, or Slower)."""

import random

import pytest

from autoplan.cost.memory import StageMemoryModel
from autoplan.cost.problem import ChainProblem
from autoplan.solve import split
from autoplan.solve.split import Slower, greedy_split


def _problem(rng: random.Random, p: int, v: int, modes: tuple[str, ...]) -> ChainProblem:
    """A chain of a few runs of identical modules (embedding, blocks, head: as captured models are) with random
    times, memory and per-stage point-to-point overheads (the first and last stages send once, the others twice)."""
    kinds = [(rng.uniform(0.1, 3.0), rng.uniform(0, 6), rng.uniform(0, 4)) for _ in range(3)]
    layout = [0] + [1] * rng.randint(2 * p * v, 4 * p * v) + [2]
    times = [kinds[k][0] for k in layout]
    states = [kinds[k][1] for k in layout]
    none = [kinds[k][2] for k in layout]
    acts = {"none": tuple(none), "selective": tuple(a * 0.5 for a in none), "full": tuple(a * 0.2 for a in none)}
    n, stages = len(layout), p * v
    models = tuple(StageMemoryModel(
        stage_index=s, per_module={"states": tuple(states)}, activations_per_microbatch={k: acts[k] for k in modes},
        per_tied_group={"states": ()}, tied_group_modules=(), largest_module={"working": tuple(none)},
        cut_per_microbatch=tuple([1.0] * (n - 1)), in_flight=stages - s) for s in range(stages))
    module_time = {"none": tuple(times), "selective": tuple(t * 1.1 for t in times),
                   "full": tuple(t * 4 / 3 for t in times)}
    whole = sum(states) + sum(none) * stages
    send, host = rng.uniform(0, 0.5), rng.uniform(0, 0.2)
    overhead = tuple(send * ((s > 0) + (s < stages - 1)) + host for s in range(stages)) if stages > 1 else ()
    return ChainProblem({k: module_time[k] for k in modes}, models, rng.uniform(0.2, 1.2) * whole / p, p, modes,
                        overhead, tuple(layout))


def _cases(count: int, seed: int) -> list[tuple[ChainProblem, str | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        p = rng.randint(1, 4)
        v = 2 if i % 3 == 2 and p > 1 else 1
        modes = [("none",), ("none", "full"), ("none", "selective"), ("full",)][i % 4]
        out.append((_problem(rng, p, v, modes), modes[0] if len(modes) == 1 else None))
    return out


CASES = _cases(160, seed=28)


def _limits(problem: ChainProblem, mode: str | None) -> list[float]:
    """Per-stage time limits from below the lower bound to well above it."""
    low = (problem.time_lower_bound() if mode is None else split._uniform_lower_bound(problem, mode)) / \
        problem.virtual_stages
    return [low * f for f in (0.9, 1.0, 1.01, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, 3.0)]


def test_time_alone_never_refutes_a_limit_the_packing_meets():
    refuted = packed = 0
    for problem, mode in CASES:
        tables = split._Tables(problem, problem.signatures)
        for limit in _limits(problem, mode):
            found = split._pack(tables, limit, problem.memory_limit_bytes, mode)
            reaches = split._reaches_end_in_time(problem, mode, limit)
            assert reaches or found is None, (problem, mode, limit)
            refuted += not reaches
            packed += found is not None
    assert refuted > 50 and packed > 50  # both outcomes are exercised


def _reference_greedy_split(problem: ChainProblem, mode: str | None, cutoff: float):
    """greedy_split's cutoff branch as it was before the early exits: pack every limit tried."""
    tables = split._Tables(problem, problem.signatures)
    v = problem.virtual_stages
    low = (problem.time_lower_bound() if mode is None else split._uniform_lower_bound(problem, mode)) / v
    tries = [x for x in (low * 1.01, (low + cutoff / v) / 2, cutoff / v) if x <= cutoff / v]
    found = next((q for q in (split._pack(tables, x, problem.memory_limit_bytes, mode) for x in tries)
                  if q is not None), None)
    if found is None:
        return "slower"
    high = max(split._stage_times(tables, found, mode))
    while high - low > split.BISECTION_TOLERANCE * high:
        middle = (low + high) / 2
        trial = split._pack(tables, middle, problem.memory_limit_bytes, mode)
        if trial is None:
            low = middle
        else:
            high, found = max(split._stage_times(tables, trial, mode)), trial
    return split._assignment(tables, found, mode)


@pytest.mark.parametrize("factor", [0.95, 1.0, 1.02, 1.1, 1.3, 2.0])
def test_greedy_split_under_a_cutoff_finds_what_packing_every_try_finds(factor):
    for problem, mode in CASES:
        if problem.num_stages > problem.num_modules:
            continue
        free = greedy_split(problem, mode)
        base = problem.bottleneck(free) if free is not None else \
            problem.time_lower_bound() if mode is None else split._uniform_lower_bound(problem, mode)
        cutoff = base * factor
        try:
            got = greedy_split(problem, mode, cutoff)
        except Slower:
            got = "slower"
        assert got == _reference_greedy_split(problem, mode, cutoff), (problem, mode, cutoff)


def test_a_cutoff_the_time_alone_refutes_builds_no_packing_tables(monkeypatch):
    """The early exit: a layout whose modules cannot be packed within the cutoff by time alone raises Slower
    before any memory table is built or any packing is tried (what the branch and bound spends its time on)."""
    built = []
    original = split._Tables.__init__

    def counting(self, *args):
        built.append(1)
        original(self, *args)

    monkeypatch.setattr(split._Tables, "__init__", counting)
    exits = 0
    for problem, mode in CASES:
        low = (problem.time_lower_bound() if mode is None else split._uniform_lower_bound(problem, mode))
        cutoff = low * 1.05
        if problem.num_stages > problem.num_modules or split._reaches_end_in_time(problem, mode,
                                                                                  cutoff / problem.virtual_stages):
            continue  # the limits tried are at most cutoff / v, and a lower limit reaches less far
        built.clear()
        with pytest.raises(Slower):
            greedy_split(problem, mode, cutoff)
        assert not built
        exits += 1
    assert exits > 10
