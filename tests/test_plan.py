"""plan.json round trip and validation: a plan is data, checked on load."""

import json
import re

import pytest

from autoplan.plan import (Alternative, ClusterRef, ModelRef, Parallelism, Plan, PlanError, Prediction, SolverInfo, Stage,
                           Training)


def make_plan() -> Plan:
    return Plan(
        model=ModelRef("model.py", "build_model", 1000),
        cluster=ClusterRef("cpu", 4, 4, 2.0**30),
        training=Training(global_batch_size=4),
        parallelism=Parallelism(dp_replicate=2, pp=2,
                                microbatches=2),
        stages=(Stage(0, ("a", "b"), 0.1, 100.0, {"parameters": 50.0}), Stage(1, ("c",), 0.1, 90.0)),
        predicted=Prediction(0.5, 16.0, None, 1e9, 0.3, 100.0, {"parameters": 50.0}),
        solver=SolverInfo("highs", "optimal", 0.01, 3),
        alternatives=(Alternative(Parallelism(dp_shard=4, reshard=True,
                                              microbatches=1), 0.6, 80.0, True,
                                  "20% slower than the best"),),
    )


def test_round_trip_is_identical():
    plan = make_plan()
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_json_has_the_design_keys():
    raw = make_plan().to_dict()
    for key in ("schema_version", "cluster", "training", "parallelism", "stages", "predicted", "solver",
                "alternatives"):
        assert key in raw
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                "pipeline_parallel_num_microbatches", "activation_checkpoint"):
        assert key in raw["parallelism"]
    for key in ("step_time_s", "samples_per_s", "tokens_per_s", "model_flops_per_step", "mfu",
                "peak_memory_bytes", "memory_breakdown"):
        assert key in raw["predicted"]
    assert set(raw["stages"][0]) >= {"index", "modules", "predicted_time_s", "predicted_memory_bytes"}
    assert set(raw["solver"]) >= {"name", "status", "time_s", "candidates_evaluated"}


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.update(schema_version=99), "schema_version"),
    (lambda r: r.pop("parallelism"), "'parallelism' must be an object"),
    (lambda r: r["parallelism"].update(pipeline_parallel_degree="2"), "pipeline_parallel_degree"),
    (lambda r: r["parallelism"].update(pipeline_parallel_schedule="zigzag"), "pipeline_parallel_schedule"),
    (lambda r: r["predicted"].pop("step_time_s"), "predicted.step_time_s is missing"),
    (lambda r: r["solver"].update(surprise=1), "unknown field"),
    (lambda r: r.update(stages={}), "stages must be a list"),
    (lambda r: r.update(paralelism={}), r"unknown top-level key\(s\): 'paralelism' \(schema version 2 has "
                                        r"model, cluster, training, parallelism,"),  # accepted silently before
    (lambda r: r.update(tensor_parallel_left_whole=[{"modules": ["a"], "op": "x", "op_module": "", "reason": "r",
                                                     "resaon": "typo"}]), "tensor_parallel_left_whole must be"),
])
def test_invalid_plans_are_rejected_with_the_field_named(mutate, message):
    raw = make_plan().to_dict()
    mutate(raw)
    with pytest.raises(PlanError, match=message):
        Plan.from_json(json.dumps(raw))


def test_not_json_is_rejected():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("\x80\x04 pickle?")


def test_a_schema_1_plan_is_refused_with_what_changed():
    raw = make_plan().to_dict()
    raw["schema_version"] = 1
    with pytest.raises(PlanError, match=r"schema_version 1, but this autoplan reads version 2 \(version 2 "
                                        r"replaced parallelism.zero_stage .*re-run autoplan"):
        Plan.from_json(json.dumps(raw))


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["parallelism"].update(pipeline_parallel_num_microbatches=3),
     "microbatches=3, but global batch 4 / dp=2 / microbatch=1 = 2"),
    (lambda r: r["cluster"].update(num_gpus=8), "dp=2 x tp=1 x pp=2 = 4, not 8 GPUs"),
    (lambda r: r["parallelism"].update(fsdp_reshard_after_forward="always"), "reshard=always needs dp_shard > 1"),
    (lambda r: r.update(activation_checkpoint_modules=["a"]), "recompute=none, but recompute_modules lists 1"),
])
def test_plans_breaking_the_layout_rules_are_refused_on_load(mutate, message):
    """Loading runs the same rules as the search and codegen (layout.problems), every one at once."""
    raw = make_plan().to_dict()
    mutate(raw)
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.from_json(json.dumps(raw))
