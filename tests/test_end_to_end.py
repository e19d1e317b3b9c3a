"""The whole pipeline on model files the planner has never seen: plan with --gpu cpu, then
`autoplan verify` runs the generated program under torchrun (gloo) and checks loss and gradient parity."""

import json
from pathlib import Path

import pytest

from autoplan.cli import main

MODELS = Path(__file__).parent / "models"


def plan_cli(tmp_path: Path, model: str, *args: str) -> dict:
    out = tmp_path / "out"
    code = main([str(MODELS / model), "--gpu", "cpu", "--out", str(out), "--quiet", *args])
    assert code == 0
    return json.loads((out / "plan.json").read_text())


def verify_cli(tmp_path: Path, capsys) -> dict:
    out = tmp_path / "out"
    code = main(["verify", str(out), "--steps", "3"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "verify.json").read_text())
    assert report["parity_max_abs_diff"] <= 1e-4
    assert report["gradient_max_rel_diff"] <= report["gradient_tolerance"] == 1e-3 and report["gradient_worst"]
    assert "first-step gradients of every parameter on every rank" in printed and "PASS" in printed
    assert len(report["losses"]) == len(report["reference_losses"]) == 3
    return report


@pytest.mark.slow
def test_pure_data_parallel_gpt_on_two_processes(tmp_path, capsys):
    # pinned: on CPU the fastest layout depends on measured op times, and this test is about pure DP
    plan = plan_cli(tmp_path, "tiny_gpt.py", "--gpus", "2", "--global-batch", "8", "--pin", "dp=2")
    par = plan["parallelism"]
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == 2
    assert par["pipeline_parallel_degree"] == 1
    assert plan["predicted"]["step_time_s"] > 0 and plan["predicted"]["peak_memory_bytes"] > 0
    assert plan["predicted"]["tokens_per_s"] > 0
    for name in ("ops.csv", "modules.csv", "candidates.csv", "stages.csv", "train.py", "model_code/tiny_gpt.py"):
        assert (tmp_path / "out" / name).is_file(), name
    verify_cli(tmp_path, capsys)


@pytest.mark.slow
def test_pinned_dp2_pp2_gpt_on_four_processes(tmp_path, capsys):
    plan = plan_cli(tmp_path, "tiny_gpt.py", "--gpus", "4", "--global-batch", "8", "--pin", "dp=2,pp=2")
    par = plan["parallelism"]
    assert par["pipeline_parallel_degree"] == 2
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == 2
    assert len(plan["stages"]) == 2 * par["pipeline_parallel_virtual_stages"]
    # the stages split the module chain in order: every block (or its parts) lands on a stage, and no
    # block of a stage comes after a block of a later stage
    blocks = [[int(m.split(".")[1]) for m in stage["modules"] if m.startswith("h.")] for stage in plan["stages"]]
    assert sorted({b for stage in blocks for b in stage}) == [0, 1, 2, 3]
    flat = [b for stage in blocks for b in stage]
    assert flat == sorted(flat)
    verify_cli(tmp_path, capsys)


@pytest.mark.slow
def test_a_module_called_twice_around_a_sibling_stays_on_one_stage_and_trains(tmp_path, capsys):
    """The heavy block's halves would balance two stages, but its LayerNorm runs after each half: cut
    between them, the program refused the plan it was given (issue 17's crash after planning)."""
    plan = plan_cli(tmp_path, "reused_module.py", "--gpus", "2", "--global-batch", "4", "--pin", "pp=2")
    assert [m for stage in plan["stages"] for m in stage["modules"]] == ["embed", "block", "head"]
    verify_cli(tmp_path, capsys)


@pytest.mark.slow
def test_memory_cap_below_the_replicated_model_changes_the_plan(tmp_path, capsys):
    replicated = plan_cli(tmp_path, "tiny_mlp.py", "--gpus", "2", "--global-batch", "8", "--pin", "dp=2,zero=0")
    assert replicated["parallelism"]["data_parallel_replicate_degree"] == 2
    cap = int(replicated["predicted"]["peak_memory_bytes"] * 0.8)
    tight = plan_cli(tmp_path, "tiny_mlp.py", "--gpus", "2", "--global-batch", "8", "--memory-per-gpu", str(cap))
    par = tight["parallelism"]
    assert par["data_parallel_replicate_degree"] == 1  # no longer replicated: sharded, pipelined or split
    assert 2 in (par["data_parallel_shard_degree"], par["pipeline_parallel_degree"], par["tensor_parallel_degree"])
    assert tight["predicted"]["peak_memory_bytes"] <= cap
    why_not = (tmp_path / "out" / "candidates.csv").read_text()
    assert "OOM" in why_not  # the replicated layouts were tried and lost on memory
    verify_cli(tmp_path, capsys)


def test_plans_for_four_gpus_without_pins(tmp_path):
    plan = plan_cli(tmp_path, "tiny_mlp.py", "--gpus", "4", "--global-batch", "16")
    par = plan["parallelism"]
    assert (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
            * par["pipeline_parallel_degree"] * par["tensor_parallel_degree"]) == 4
    assert plan["solver"]["candidates_evaluated"] >= 2


@pytest.mark.parametrize("example", ["gpt.py", "mlp.py"])
def test_shipped_examples_plan_for_eight_h100(tmp_path, example):
    out = tmp_path / "out"
    examples = Path(__file__).parent.parent / "examples"
    assert main([str(examples / example), "--gpus", "8", "--out", str(out), "--quiet"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"]["gpu"] == "h100-sxm5-80gb"
    assert 0 < plan["predicted"]["mfu"] < 1


@pytest.mark.slow
def test_the_readme_cpu_example_plans_and_verifies(tmp_path, capsys):
    """README: autoplan examples/mlp.py --gpus 2 --gpu cpu --out DIR && autoplan verify DIR"""
    examples = Path(__file__).parent.parent / "examples"
    out = tmp_path / "out"
    assert main([str(examples / "mlp.py"), "--gpus", "2", "--gpu", "cpu", "--out", str(out), "--quiet"]) == 0
    verify_cli(tmp_path, capsys)
