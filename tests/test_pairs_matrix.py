"""Every pair of plan values the planner can emit together trains with parity (issue 26): the factors are the plan
vocabulary's values (tests/pairs_matrix.py), an all-pairs covering array (tests/helpers/all_pairs.py) picks the
cases, and every case runs under verify's parity check (losses and first-step gradients) in one shared launch.
A pair the layout rules refuse is listed with the rule's reason. The fast tests check the matrix's construction:
a value added to the vocabulary without a way to run it, or its pairs left uncovered, fails them."""

from __future__ import annotations

import itertools

import pytest

import pairs_matrix as pm
from autoplan.layout import SUPPORTED, ZERO_STAGES
from helpers.all_pairs import Factor, all_cases, covering_array, pairs_of
from helpers.verify_many import verify_many
from test_layouts import check_parity


def test_the_covering_array_holds_every_pair_an_allowed_case_holds_and_lists_the_rest():
    factors = (Factor("a", (1, 2, 3)), Factor("b", ("x", "y")), Factor("c", (True, False), lambda c: c["a"] > 1))

    def reasons(case):
        return ["a=3 with b=y"] if (case["a"], case["b"]) == (3, "y") else []

    covering = covering_array(factors, reasons)
    covered = {p for case in covering.cases for p in pairs_of(case, factors)}
    assert covered == covering.pairs
    assert (("a", 3), ("b", "y")) in covering.refused and covering.refused[("a", 3), ("b", "y")] == ["a=3 with b=y"]
    assert (("a", 1), ("c", True)) not in covering.pairs | set(covering.refused)  # c does not apply at a=1
    assert all(not reasons(case) for case in covering.cases)
    assert len(covering.cases) < len(all_cases(factors))


def test_every_factor_value_is_the_vocabularys():
    values = {f.name: set(f.values) for f in pm.factors()}
    assert values["recompute"] == set(pm.RECOMPUTE) and values["reshard"] == set(pm.RESHARD)
    assert values["sp"] == set(pm.SEQUENCE_PARALLEL) and values["offload"] == set(pm.OFFLOAD)
    assert values["compile"] == set(pm.COMPILE) and values["optimizer"] == set(pm.OPTIMIZER_IMPLEMENTATIONS)
    assert {s for s in values["pipeline"] if s != "pp=1"} == set(pm.SCHEDULES)
    assert set(pm.ZERO) == set(ZERO_STAGES)  # every zero stage is a (data, reshard) of the matrix
    for zero, (data, reshard) in pm.ZERO.items():
        assert data in values["data"] and reshard in values["reshard"] | {None}


def test_every_supported_feature_is_a_matrix_value_or_a_pair_of_them():
    assert set(pm.FEATURE_VALUES) == set(SUPPORTED), set(SUPPORTED) ^ set(pm.FEATURE_VALUES)
    values = {(f.name, v) for f in pm.factors() for v in f.values}
    for feature, value in pm.FEATURE_VALUES.items():
        assert value is None or value in values, (feature, value)


def test_every_pair_the_rules_allow_is_covered_and_every_other_is_refused_by_a_rule():
    matrix = pm.matrix()
    factors = pm.factors()
    covered = {p for case in matrix.cases for p in pairs_of(case, factors)}
    assert matrix.pairs <= covered
    every = {p for case in all_cases(factors) for p in pairs_of(case, factors)}
    assert every == matrix.pairs | set(matrix.refused)  # nothing dropped silently
    assert all(matrix.refused.values()), [p for p, why in matrix.refused.items() if not why]  # a rule, not the budget
    for case in matrix.cases:
        assert pm.reasons(case) == [] and pm.ranks(case) <= pm.MAX_RANKS


def test_each_cases_plan_runs_the_case(tmp_path):
    """A value the plan writer does not know (a new offload target, say) would run as another: every value of every
    case must come back from its plan.json."""
    for case in pm.matrix().cases:
        plan = pm.plan_of(case, tmp_path / "model.py")
        assert pm.runs_as(plan) == {k: v for k, v in case.items() if k != "model"}, pm.name(case)
        assert plan.problems() == [], (pm.name(case), plan.problems())


@pytest.mark.parametrize("recompute, kind", list(pm.REQUIRED), ids=lambda x: x)
def test_compile_with_recompute_runs_beside_each_kind_of_parallelism(recompute, kind):
    assert any(c["compile"] == "on" and c["recompute"] == recompute and pm.PARALLELISMS[kind](c)
               for c in pm.matrix().cases)
    assert {k for _, k in pm.REQUIRED} == {"dp", "fsdp", "pp", "tp+sp"}


def test_the_refused_pairs_name_their_rule():
    refused = pm.matrix().refused
    offload_pp = refused[("pipeline", "1f1b"), ("offload", "cpu")]
    assert any("offload=cpu with pp=2" in why for why in offload_pp)
    batch_norm = refused[("model", "resnet"), ("recompute", "full")]
    assert any("BatchNorm module 'stem.1'" in why for why in batch_norm)
    for (a, b), why in sorted(refused.items(), key=str):  # the list the report shows, pytest -rP
        print(f"{a[0]}={a[1]} x {b[0]}={b[1]}: {'; '.join(why)}")


# the matrix itself: every case trains under verify's parity check (slow) ------------------------------------------

@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    cases = pm.matrix().cases
    folders = [pm.write_case(root, i, case) for i, case in enumerate(cases)]
    return verify_many(folders, steps=pm.STEPS, timeout_s=3000, nproc=pm.MAX_RANKS).results


@pytest.mark.slow  # one 8-process torchrun launch of every case (inductor builds C++ for the compiled ones)
@pytest.mark.parametrize("index", range(len(pm.matrix().cases)), ids=lambda i: pm.name(pm.matrix().cases[i]))
def test_every_case_of_the_matrix_trains_like_the_single_device_model(verified, index):
    check_parity(verified[index])


@pytest.mark.slow  # captures each of the matrix's models (seconds each)
@pytest.mark.parametrize("model", list(pm.models()))
def test_the_stated_model_facts_are_the_captured_models(tmp_path, model):
    """The rules decide the matrix from facts stated in tests/pairs_matrix.py: they must be what autoplan finds in
    the model (autoplan.solve.layouts.scope_of on its capture), or the matrix would test other pairs than the
    planner emits."""
    captured = pm.captured_facts(tmp_path, model)
    stated = pm.scope(model, 2)
    for name in ("sequence_parallel_problem", "loss_parallel_problem", "batch_norm_modules", "sequence_length",
                 "context_parallel_problem", "num_experts", "sequence_local_modules"):
        assert (getattr(stated, name) or None) == (captured[name] or None), name  # "", () and None: none
    assert (stated.tensor_parallel_problems or (lambda tp: []))(2) == captured["tensor_parallel_problems"](2)
