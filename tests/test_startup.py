"""train.py knows its plan and how it must be launched (issue 30): the plan's fingerprint in train.py
(PLAN_FINGERPRINT), its start-up refusal beside another plan.json, `autoplan verify` failing a train.py that is not
plan.json's, and launch mistakes (no torchrun, another number of processes, a launcher's
NPROC_PER_NODE) as one line and exit code 2, with arithmetic that names every factor of the world size."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.errors import UserError
from autoplan.plan import Prediction, SolverInfo
from autoplan.runtime.distributed.config import ParallelConfig
from autoplan.runtime.startup import launch_problem, plan_mismatch
from autoplan.verify import VerifySettings, verify
from helpers.plans import pinned_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MLP = EXAMPLES / "mlp.py"
MLP_UNITS = [("inp", *(f"layers.{i}" for i in range(6)), "out")]
GPT = EXAMPLES / "gpt.py"
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}


def dp2_plan(model: Path = MLP):
    return pinned_plan(model, MLP_UNITS, dp_replicate=2, microbatch=4)


def tp2_plan(model: Path = MLP):
    units = {f"layers.{i}.0": ("colwise" if i % 2 == 0 else "rowwise") for i in range(6)}
    return pinned_plan(model, MLP_UNITS, tp=2, microbatch=8,
                       tensor_parallel_plan=units)


def cp2_plan():
    return pinned_plan(GPT, [("wte", "wpe", *(f"blocks.{i}" for i in range(4)), "ln_f", "lm_head")], cp=2,
                       microbatch=8)


def program(folder: Path, plan, plan_json=None) -> Path:
    """An output folder: train.py generated from `plan`, and beside it `plan_json` (default: `plan`)."""
    write_program(plan, folder, plan.model.path)
    (folder / "plan.json").write_text((plan_json or plan).to_json())
    return folder


def test_the_fingerprint_follows_what_trains_not_what_is_predicted():
    plan = dp2_plan()
    assert plan.fingerprint() == type(plan).from_json(plan.to_json()).fingerprint()  # what train.py and plan.json hold
    assert tp2_plan().fingerprint() != plan.fingerprint()
    assert replace(plan, training=replace(plan.training, seed=4)).fingerprint() != plan.fingerprint()
    repriced = replace(plan, predicted=Prediction(step_time_s=9.0, samples_per_s=1.0, tokens_per_s=None,
                                                  model_flops_per_step=1.0, mfu=0.5, peak_memory_bytes=1.0),
                       solver=SolverInfo(name="highs", status="optimal", time_s=3.0, candidates_evaluated=7))
    assert repriced.fingerprint() == plan.fingerprint()


def test_train_py_carries_its_plans_fingerprint(tmp_path):
    out = program(tmp_path / "out", dp2_plan())
    assert f"PLAN_FINGERPRINT = {dp2_plan().fingerprint()!r}" in (out / "train.py").read_text()


def test_a_program_refuses_a_plan_it_was_not_generated_from_with_both_layouts(tmp_path):
    dp2 = ParallelConfig.of(dp2_plan())
    beside = tmp_path / "plan.json"
    beside.write_text(tp2_plan().to_json())
    problem = plan_mismatch(dp2_plan().fingerprint(), dp2, beside, given=False)
    assert "is not the plan this train.py was generated from" in problem
    assert ("plan.json is for pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2 = 2 processes, train.py for pp 1 x "
            "dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2 processes") in problem
    beside.write_text(dp2_plan().to_json())
    assert plan_mismatch(dp2_plan().fingerprint(), dp2, beside, given=False) is None
    assert plan_mismatch(dp2_plan().fingerprint(), dp2, tmp_path / "none.json", given=False) is None  # copied alone
    assert "no such file" in plan_mismatch(dp2_plan().fingerprint(), dp2, tmp_path / "none.json", given=True)
    beside.write_text("{}")
    assert "cannot check" in plan_mismatch(dp2_plan().fingerprint(), dp2, beside, given=False)


def test_launch_mistakes_name_every_factor_of_the_world_size():
    cp2 = ParallelConfig.of(cp2_plan())
    assert launch_problem(cp2, {**TORCHRUN, "WORLD_SIZE": "2"}) is None
    wrong = launch_problem(cp2, {**TORCHRUN, "WORLD_SIZE": "4"})
    assert wrong.startswith("4 processes were started (WORLD_SIZE=4")
    assert "the plan is for pp 1 x dp_replicate 1 x dp_shard 1 x cp 2 x tp 1 = 2 processes" in wrong
    assert "--nproc-per-node 2" in wrong
    bare = launch_problem(cp2, {})
    assert "under torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in bare
    assert "autoplan verify DIR checks it on this machine's CPU" in bare
    assert launch_problem(cp2, {}, running_world=2) is None  # a process group already started (tests' batch)


def test_verify_fails_a_train_py_of_another_plan_before_running_it(tmp_path):
    """A dp=2 train.py beside a tp=2 plan.json used to verify as PASS (the program checks only itself)."""
    out = program(tmp_path / "out", dp2_plan(), plan_json=tp2_plan())
    with pytest.raises(UserError, match=r"train.py was not generated from .*plan.json \(train.py's PLAN_FINGERPRINT "
                                        rf"{dp2_plan().fingerprint()}, plan.json's {tp2_plan().fingerprint()}; "
                                        r"plan.json is for pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 2 = 2"):
        verify(out, VerifySettings(steps=1, timeout_s=1))
    recorded = json.loads((out / "verify.json").read_text())
    assert recorded["passed"] is False and "not generated from" in recorded["error"]


def test_verify_nproc_arithmetic_includes_cp(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text(cp2_plan().to_json())
    with pytest.raises(UserError, match=r"^--nproc 4 does not match the plan: pp 1 x dp_replicate 1 x dp_shard 1 x "
                                        r"cp 2 x tp 1 = 2 processes$"):
        verify(out, VerifySettings(nproc=4))


def run_train_py(out: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in TORCHRUN and k != "LOCAL_WORLD_SIZE"}
    return subprocess.run([sys.executable, "train.py", *args], cwd=out, env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), result.stderr
    return lines[0]


def test_train_py_start_up_mistakes_are_one_line_and_exit_2(tmp_path):
    """Each was a 29-91 line traceback: python train.py without torchrun, a plan.json beside it that is not its own,
    torchrun's variables for another world size (as `torchrun --nproc-per-node 3` sets them, rank 1 printing nothing)."""
    out = program(tmp_path / "out", dp2_plan())
    assert "under torchrun" in one_error_line(run_train_py(out, ["--steps", "1"]))
    wrong = run_train_py(out, ["--steps", "1"], {**TORCHRUN, "WORLD_SIZE": "3"})
    assert "3 processes were started" in one_error_line(wrong)
    silent = run_train_py(out, ["--steps", "1"], {**TORCHRUN, "WORLD_SIZE": "3", "RANK": "1", "LOCAL_RANK": "1"})
    assert silent.returncode == 2 and not silent.stderr.strip(), silent.stderr
    (out / "plan.json").write_text(tp2_plan().to_json())
    assert "not the plan this train.py was generated from" in one_error_line(run_train_py(out, []))
    (out / "plan.json").write_text(dp2_plan().to_json())
    other = tmp_path / "tp2.json"
    other.write_text(tp2_plan().to_json())
    assert "tp2.json is not the plan" in one_error_line(run_train_py(out, ["--plan", str(other)]))


def test_torchrun_sh_refuses_another_number_of_processes(tmp_path):
    out = program(tmp_path / "out", dp2_plan())
    result = subprocess.run(["bash", "launch/torchrun.sh", "--steps", "1"], cwd=out, capture_output=True, text=True,
                            env={**os.environ, "NPROC_PER_NODE": "3"}, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("launch/torchrun.sh: error: NNODES x NPROC_PER_NODE = 1 x 3 = 3 processes, but "
                                     "the plan is for pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2 processes")


@pytest.mark.slow  # one 3-process torchrun start (15-40 s here)
def test_torchrun_with_another_number_of_processes_says_why_once(tmp_path):
    """Under a real torchrun --nproc-per-node 3 for a 2-process plan: train.py's one line, once (local rank 0), and
    exit code 2 as the root cause; torchrun's own summary follows (its ChildFailedError, which train.py cannot
    silence: launch/torchrun.sh refuses the mistake before torchrun starts)."""
    out = program(tmp_path / "out", dp2_plan())
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                             "train.py", "--steps", "1", "--device", "cpu"], cwd=out, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if "train.py: error:" in line]
    assert len(ours) == 1 and "3 processes were started" in ours[0], result.stderr
    assert 'train.py", line' not in result.stderr and "autoplan" not in result.stderr  # no rank's traceback
    root_cause = result.stderr.split("Root Cause (first observed failure)")[1]
    assert "exitcode  : 2" in root_cause, result.stderr


@pytest.mark.parametrize("argv, message", [
    (["--stpes", "3"], "unrecognized arguments: --stpes 3"),
    (["--steps", "0"], "--steps must be at least 1 (the optimizer steps to train until), not 0"),
    (["--steps", "three"], "argument --steps: invalid int value: 'three'"),
    (["--process-group-timeout", "-5"], "--process-group-timeout must be a positive number of seconds, not -5"),
])
def test_argument_mistakes_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    """argparse printed its usage block first: a dozen lines of train.py's options above the error."""
    out = program(tmp_path / "out", dp2_plan())
    spec = importlib.util.spec_from_file_location("autoplan_startup_train", out / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [str(out / "train.py")])
    with pytest.raises(SystemExit) as stopped:
        module.parse_args(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"train.py: error: {message} (see train.py --help)"]
