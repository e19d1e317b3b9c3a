"""layout.Parallelism: the one layout type (short names, real types), its partial twin Layout, and the one codec to
plan.json's names (VOCABULARY's plan_field and plan_values)."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from autoplan.layout import (SCHEDULE_BY_NAME, VOCABULARY, Layout, Parallelism, Scope, from_plan_fields, rank_stages,
                             stage_rank, to_plan_fields)

OTHER = {"dp_replicate": 2, "dp_shard": 4, "reshard": True, "tp": 2, "pp": 2, "schedule": "interleaved",
         "microbatch": 3, "microbatches": 6, "recompute": "full", "virtual_stages": 3, "sp": True,
         "loss_parallel": False, "offload": True, "cp": 2, "ep": 4}
"""A value other than the default for every field."""


def test_every_field_is_a_vocabulary_term_with_a_plan_field():
    terms = {t.short: t for t in VOCABULARY}
    for f in fields(Parallelism):
        assert f.name in terms, f.name
        assert terms[f.name].plan_field and " " not in terms[f.name].plan_field, f.name


@pytest.mark.parametrize("name", sorted(OTHER))
def test_codec_round_trips_each_term_through_plan_json(name):
    par = replace(Parallelism(), **{name: OTHER[name]})
    assert getattr(par, name) != getattr(Parallelism(), name)
    section = json.loads(json.dumps(to_plan_fields(par)))
    plan_field = next(t.plan_field for t in VOCABULARY if t.short == name)
    assert section[plan_field] != to_plan_fields(Parallelism())[plan_field]  # the change lands on its own key
    assert from_plan_fields(section) == par


def test_codec_keeps_plan_json_names_values_and_order():
    section = to_plan_fields(Parallelism(**OTHER))
    assert list(section) == [
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
        "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
        "pipeline_parallel_microbatch_size", "pipeline_parallel_num_microbatches", "activation_checkpoint",
        "pipeline_parallel_virtual_stages", "enable_sequence_parallel", "disable_loss_parallel", "enable_cpu_offload",
        "context_parallel_degree", "expert_parallel_degree"]
    assert section["fsdp_reshard_after_forward"] == "always" and section["disable_loss_parallel"] is True
    assert to_plan_fields(Parallelism())["fsdp_reshard_after_forward"] == "never"
    assert to_plan_fields(Parallelism())["disable_loss_parallel"] is False


def test_codec_defaults_absent_fields_and_refuses_bad_values():
    assert from_plan_fields({"tensor_parallel_degree": 2}) == Parallelism(tp=2)
    for bad in ({"fsdp_reshard_after_forward": "default"}, {"fsdp_reshard_after_forward": True},
                {"disable_loss_parallel": "yes"}, {"tensor_parallel_degree": True}, {"tensor_parallel_degree": "2"},
                {"tp": 2}):
        with pytest.raises(ValueError, match="parallelism"):
            from_plan_fields(bad)


def test_layout_is_the_partial_twin():
    par = Parallelism(**OTHER)
    assert Parallelism.of(par.layout()) == par
    assert par.layout().sp == "on" and par.layout().reshard == "always" and par.layout().offload == "cpu"
    assert Parallelism.of(Layout()) == Parallelism()
    zero3 = Parallelism.of(Layout(dp=8, zero=3))
    assert (zero3.dp_shard, zero3.dp_replicate, zero3.reshard) == (8, 1, True)
    ddp = Parallelism.of(Layout(dp=8, zero=0))
    assert (ddp.dp_shard, ddp.dp_replicate, ddp.reshard) == (1, 8, False)


def test_derived_facts():
    par = Parallelism(dp_replicate=2, dp_shard=2, cp=2, tp=4, pp=3, ep=4)
    assert (par.dp, par.fsdp_shard, par.world_size) == (4, 4, 96)
    assert par.fsdp_enabled and not par.reshards_after_forward and par.tp_enabled and par.ep_enabled
    assert par.world_size_arithmetic() == "pp 3 x dp_replicate 2 x dp_shard 2 x cp 2 x tp 4 = 96 processes"
    assert Parallelism(cp=2).fsdp_enabled and not Parallelism(dp_replicate=8).fsdp_enabled
    for name in ("interleaved", "zbv"):
        v = 2
        par = Parallelism(pp=4, schedule=name, virtual_stages=v)
        placement = SCHEDULE_BY_NAME[name].placement
        assert [par.stage_rank(s) for s in range(8)] == [stage_rank(s, 4, placement) for s in range(8)]
        assert par.rank_stages(1) == rank_stages(1, 4, v, placement)


def test_problems_are_the_layout_rules():
    assert Parallelism(dp_shard=4, tp=2).problems(Scope(num_gpus=8)) == []
    assert Parallelism(tp=3).problems(Scope(num_gpus=8)) == ["tp=3 does not divide 8 GPUs",
                                                            "dp=1 x tp=3 x pp=1 = 3, not 8 GPUs"]
    assert any("offload=cpu" in p for p in Parallelism(dp_replicate=2, offload=True).problems(Scope()))


def test_a_plan_json_written_before_the_one_type_loads_and_writes_back_the_same():
    """tests/fixtures/plan_schema2_main_276da8a.json: autoplan examples/gpt.py --gpus 8 --pin
    tp=2,pp=2,schedule=interleaved,zero=3 as main 276da8a wrote it (plan.Parallelism with the long names; its model
    path made relative). It loads into the one type and its parallelism sections come back key for key."""
    from pathlib import Path

    from autoplan.plan import Plan

    text = (Path(__file__).parent / "fixtures" / "plan_schema2_main_276da8a.json").read_text()
    plan = Plan.from_json(text)
    assert plan.parallelism == Parallelism(dp_shard=2, reshard=True, tp=2, pp=2, schedule="interleaved",
                                           microbatch=8, microbatches=2, virtual_stages=3)
    assert all(isinstance(a.parallelism, Parallelism) for a in plan.alternatives) and plan.alternatives
    assert plan.to_json() == text.removesuffix("\n")  # byte for byte (the fixture ends with a newline)


def test_a_field_reads_by_its_plan_json_name_with_plan_json_value():
    """Code written against plan.json's keys (a user's own loop: plan.parallelism.pipeline_parallel_microbatch_size)
    keeps reading a plan: every plan.json field, by its name, gives what plan.json stores."""
    from autoplan.layout import to_plan_fields

    par = Parallelism(dp_shard=4, reshard=True, tp=2, sp=True, loss_parallel=False, microbatch=3, cp=2, ep=2)
    for key, value in to_plan_fields(par).items():
        assert getattr(par, key) == value, key
    assert par.fsdp_reshard_after_forward == "always" and par.disable_loss_parallel is True
    with pytest.raises(AttributeError, match="no attribute 'tensor_parallel'"):
        par.tensor_parallel  # noqa: B018 - not a plan.json name
