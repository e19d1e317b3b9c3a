"""autoplan.verify's standard path (one torchrun per folder, as a user runs it) on two generated
programs, verify_many's shared launch reporting a failing job next to a passing one, and how verify
reports hung, failing and diverging runs (stand-in train.py files that do not import torch).
Parity of every layout: test_layouts.py (one shared launch)."""

import json
import math
import re
import textwrap
import time
from pathlib import Path

import pytest
import torch

from autoplan.codegen import write_program
from autoplan.errors import UserError
from autoplan.plan import Plan
from autoplan.cli import main
from autoplan.verify import (GRADIENT_FLOOR, GRADIENT_TOLERANCE, ROOT_CAUSE_CHARS, VerifySettings, _Run,
                             compare_gradients, root_cause, verify)
from helpers.plans import pinned_plan
from helpers.verify_many import verify_many
from test_layouts import SKIP_NET, TINY_GPT

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = Path(__file__).parent / "models"
GPT_STAGES = [("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f", "lm_head")]
MLP_UNITS = [("inp", *(f"layers.{i}" for i in range(6)), "out")]


def make_plan(model_path: Path, global_batch: int, stages, **parallelism) -> Plan:
    return pinned_plan(model_path, stages, global_batch=global_batch, **parallelism)


def write_out(tmp_path: Path, model_text: str | None, plan_args: tuple, model_file: Path | None = None) -> Path:
    if model_file is None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        model_file = tmp_path / "user_model.py"
        model_file.write_text(model_text)
    plan = make_plan(model_file, *plan_args[:2], **plan_args[2])
    out = tmp_path / "out"
    write_program(plan, out, model_file)
    (out / "plan.json").write_text(plan.to_json())
    return out


CASES = {
    "mlp dp=2 DDP, 2 accumulated micro-batches": (
        None, EXAMPLES / "mlp.py", (8, MLP_UNITS, dict(dp_replicate=2,
                                                       microbatches=2, microbatch=2))),
    "gpt pp=2 gpipe, tied lm_head across stages": (
        TINY_GPT, None, (8, GPT_STAGES, dict(pp=2, schedule="gpipe",
                                             microbatches=4, microbatch=2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_loss_parity_with_the_single_device_reference(tmp_path, case):
    model_text, model_file, plan_args = CASES[case]
    out = write_out(tmp_path, model_text, plan_args, model_file)
    measure = case.startswith("mlp")  # one case also measures step time and memory
    result = verify(out, VerifySettings(steps=2, timeout_s=240, measure=measure))
    assert result.passed, (result.reference_losses, result.losses)
    assert result.parity_max_abs_diff <= 1e-4
    report = json.loads((out / "verify.json").read_text())
    assert report["nproc"] == make_plan(Path("m.py"), *plan_args[:2], **plan_args[2]).parallelism.world_size
    assert len(report["losses"]) == len(report["reference_losses"]) == 2
    assert report["reference_losses"][0] != report["reference_losses"][1]  # step 2 sees the update
    if measure:
        assert report["measured_step_time_s"] > 0 and report["measured_peak_memory_bytes"] > 2**20
        assert report["predicted_step_time_s"] == 0.05


def test_nproc_other_than_the_plan_is_rejected_with_the_arithmetic(tmp_path):
    out = write_out(tmp_path, TINY_GPT, (8, GPT_STAGES, dict(dp_replicate=2, pp=2,
                                                             microbatches=2,
                                                             microbatch=2)))
    with pytest.raises(UserError, match=r"--nproc 2 .* pp 2 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 4 processes"):
        verify(out, VerifySettings(nproc=2))


def fake_program(tmp_path: Path, body: str) -> Path:
    """A plan folder whose train.py is a stand-in (no torch import: its ranks start fast). Its body runs on import:
    in the distributed run's ranks (RANK set) and in the reference run (the harness imports it), and the stand-in
    ends its process itself, as if it had trained."""
    out = write_out(tmp_path, SKIP_NET, (4, [("embed", "mid", "head")], dict(dp_replicate=2,
                                                                            microbatch=2)))
    fingerprint = next(line for line in (out / "train.py").read_text().splitlines()
                       if line.startswith("PLAN_FINGERPRINT = "))  # verify checks it is plan.json's program
    header = "import json, os, sys, time\nreference = 'RANK' not in os.environ\n" \
             "out = sys.argv[sys.argv.index('--losses-out') + 1]\nrank = int(os.environ.get('RANK', 0))\n"
    (out / "train.py").write_text(f"{fingerprint}\n{header}{textwrap.dedent(body)}\nsys.exit(0)\n")
    return out


@pytest.mark.slow
def test_a_hung_run_is_killed_with_its_whole_process_group(tmp_path):
    out = fake_program(tmp_path, f"""
        open({str(tmp_path)!r} + f"/pid.{{os.getpid()}}", "w").close()
        print("waiting forever", file=sys.stderr, flush=True)
        time.sleep(600)
    """)
    # the reference imports autoplan.runtime (torch) before the stand-in: seconds on a loaded machine
    with pytest.raises(UserError, match=r"reference run did not finish within 30 s(.|\n)*waiting forever"):
        verify(out, VerifySettings(timeout_s=30))
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
    assert len(pids) >= 2  # the reference and at least one rank had started
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously to the group's members
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)


def is_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that never reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    out = fake_program(tmp_path, """
        if not reference and rank == 1:
            raise RuntimeError("stage 1 blew up")
        if reference or rank == 0:
            json.dump([1.0, 0.5], open(out, "w"))
    """)
    with pytest.raises(UserError, match=r"distributed run \(2 processes\) failed(.|\n)*stage 1 blew up"):
        verify(out, VerifySettings(steps=2))
    report = json.loads((out / "verify.json").read_text())  # a failed run is recorded too
    assert report["passed"] is False and report["losses"] == [] and "stage 1 blew up" in report["error"]


@pytest.mark.slow
def test_diverging_losses_fail_and_are_written_down(tmp_path):
    out = fake_program(tmp_path, """
        if reference or rank == 0:
            json.dump([1.0, 0.5] if reference else [1.0, 0.4], open(out, "w"))
    """)
    result = verify(out, VerifySettings(steps=2))
    assert not result.passed and result.parity_max_abs_diff == pytest.approx(0.1)
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] is False and report["losses"] == [1.0, 0.4]


MAIN_START = "def main(argv=None) -> list[float]:\n    args = parse_args(argv)\n"
"""Where a generated train.py's main begins: tests plant a fault after it."""


def plant(out: Path, code: str) -> None:
    """Insert `code` (one indented line) at the start of out/train.py's main."""
    train_py = out / "train.py"
    assert train_py.read_text().count(MAIN_START) == 1
    train_py.write_text(train_py.read_text().replace(MAIN_START, MAIN_START + code + "\n"))


@pytest.mark.slow
def test_verify_many_reports_a_failing_program_and_checks_the_others(tmp_path):
    folders = []
    for name in ("good", "bad"):
        folders.append(write_out(tmp_path / name, SKIP_NET, (4, [("embed", "mid", "head")], dict(
            dp_replicate=2, microbatch=2))))
    plant(folders[1], "    raise RuntimeError('stage 1 blew up')")  # on every rank: each one's error names it
    good, bad = verify_many(folders, steps=2, timeout_s=300).results
    assert good.passed and len(good.losses) == 2 and not good.error and good.gradient_max_rel_diff < 1e-5
    assert not bad.passed and "stage 1 blew up" in bad.error
    assert json.loads((folders[1] / "verify.json").read_text())["passed"] is False


def write_gradients(directory: Path, rank: int, gradients: dict, aliases=()) -> None:
    directory.mkdir(exist_ok=True)
    torch.save({"gradients": gradients, "aliases": [list(a) for a in aliases]}, directory / f"rank{rank}.pt")


def reference_w() -> torch.Tensor:
    return torch.tensor([[1.0, -4.0], [2.0, 0.5]])


def gradient_check(tmp_path: Path, ranks: list[dict | None]):
    """compare_gradients of a reference with w (2 x 2), a weight tied under the names t and u, and b (zeros)
    against each rank's reports (None: the rank wrote no file)."""
    tmp_path.mkdir(exist_ok=True)
    write_gradients(tmp_path / "reference", 0, {"w": reference_w(), "t": torch.ones(3), "u": torch.ones(3),
                                               "b": torch.zeros(2)}, [("t", "u")])
    for rank, found in enumerate(ranks):
        if found is not None:
            write_gradients(tmp_path / "ranks", rank, found)
    return compare_gradients(tmp_path / "reference", tmp_path / "ranks", len(ranks))


def test_gradients_are_compared_per_parameter_relative_to_its_largest_entry(tmp_path):
    check = gradient_check(tmp_path, [{"w": torch.tensor([[1.0, -4.0], [2.0, 0.5 + 4e-6]]), "b": torch.zeros(2)},
                                      {"u": torch.ones(3), "b": torch.zeros(2)}])
    assert check.passed and check.max_rel_diff == pytest.approx(1e-6, rel=1e-2) and check.worst == "w on rank 0"


def test_a_gradient_halved_fails_the_check_by_the_factor(tmp_path):
    check = gradient_check(tmp_path, [{"w": reference_w() / 2, "t": torch.ones(3), "b": torch.zeros(2)}])
    assert not check.passed and check.max_rel_diff == pytest.approx(0.5) and not check.problem
    assert GRADIENT_TOLERANCE < 0.5


def test_rounding_noise_on_a_zero_gradient_is_measured_against_the_models_largest_gradient(tmp_path):
    # b is zero in exact arithmetic: 1e-12 against 3e-12 is a 200% difference of noise, 5e-10 of the floor
    noise = gradient_check(tmp_path / "noise", [{"w": reference_w(), "t": torch.ones(3), "b": torch.full((2,), 3e-12)}])
    assert noise.passed and noise.max_rel_diff == pytest.approx(3e-12 / (GRADIENT_FLOOR * 4.0), rel=1e-3)
    # a real gradient on b, however small next to w's: its error counts against the floor (4e-3)
    wrong = gradient_check(tmp_path / "wrong", [{"w": reference_w(), "t": torch.ones(3), "b": torch.ones(2)}])
    assert not wrong.passed and wrong.max_rel_diff == pytest.approx(250) and wrong.worst == "b on rank 0"


@pytest.mark.parametrize("ranks, problem", [
    ([{"w": reference_w(), "b": torch.zeros(2)}], r"no rank reports the gradient of 1 .*e\.g\. 't'"),
    ([{"w": reference_w(), "t": torch.ones(3), "b": torch.zeros(2), "x": torch.ones(1)}], r"rank 0 .* 'x', a name"),
    ([{"w": reference_w()[0], "t": torch.ones(3), "b": torch.zeros(2)}], r"rank 0's gradient of 'w' has shape \(2,\)"),
    ([{"w": reference_w(), "t": torch.ones(3), "b": torch.zeros(2)}, None], r"rank 1 .* wrote no gradients"),
    ([{"w": reference_w() * math.nan, "t": torch.ones(3), "b": torch.zeros(2)}], None),
], ids=["unreported", "unknown name", "shape", "rank without a file", "nan"])
def test_a_gradient_no_rank_reports_or_the_model_lacks_fails_with_its_name(tmp_path, ranks, problem):
    check = gradient_check(tmp_path, ranks)
    assert not check.passed and check.max_rel_diff == math.inf
    if problem is None:  # a NaN gradient: an infinite difference
        assert check.worst == "w on rank 0" and not check.problem
    else:
        assert re.search(problem, check.problem), check.problem


PIPELINE_STDERR = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/user/out/train.py", line 185, in main
[rank0]:     local_loss = forward_backward(inputs, targets)
[rank0]:   File "/usr/lib/python3.11/site-packages/torch/distributed/pipelining/schedules.py", line 683, in _wait_batch_p2p
[rank0]:     w.wait()
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10948.
[rank1]: Traceback (most recent call last):
[rank1]:   File "/usr/lib/python3.11/site-packages/torch/distributed/pipelining/stage.py", line 892, in forward_one_chunk
[rank1]:     output = self.forward_maybe_with_nosync(*composite_args, **composite_kwargs)
[rank1]:   File "<eval_with_key>.12", line 8, in forward
[rank1]:   File "/usr/lib/python3.11/site-packages/torch/_ops.py", line 875, in __call__
[rank1]:     return self._op(*args, **kwargs)
[rank1]:   File "/home/user/models/failing_stage.py", line 17, in rank_check
[rank1]:     raise ValueError(MESSAGE)
[rank1]:   File "/usr/lib/python3.11/site-packages/torch/_library/custom_ops.py", line 502, in wrapped_fn
[rank1]:     return fn(*args, **kwargs)
[rank1]: ValueError: rank-only failure: values out of range in the last block

[rank1]: The above exception was the direct cause of the following exception:

[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/user/out/train.py", line 185, in main
[rank1]:     local_loss = forward_backward(inputs, targets)
[rank1]:   File "/usr/lib/python3.11/site-packages/torch/distributed/pipelining/stage.py", line 900, in forward_one_chunk
[rank1]:     raise RuntimeError(exc_msg) from e
[rank1]: RuntimeError:
[rank1]:             [Stage 1] failed to run forward:
[rank1]:             args: ('Tensor(torch.Size([4, 16]), grad=True, dtype=torch.float32)',)
[rank1]:             kwargs: {}
[rank1]:
E1123 21:49:02.900000 21100 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_21:49:02
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 21145)
============================================================
"""


def test_root_cause_is_the_original_exception_of_the_rank_torchrun_names():
    # rank 0's broken connection prints first; torchrun names rank 1, whose first traceback is the
    # original exception, chained under the pipeline stage's "[Stage 1] failed to run forward"
    lines = PIPELINE_STDERR.splitlines()
    assert root_cause(lines) == ("ValueError: rank-only failure: values out of range in the last block "
                                 "(rank 1, at /home/user/models/failing_stage.py:17 in rank_check)")
    without_summary = lines[:lines.index("============================================================")]
    assert root_cause(without_summary).startswith("RuntimeError: [../gloo/transport")  # then the first rank's
    assert "rank 0, at /home/user/out/train.py:185 in main" in root_cause(without_summary)


def test_root_cause_of_one_process_joins_a_multi_line_message_and_is_none_without_a_traceback():
    lines = ["Traceback (most recent call last):",
             '  File "/usr/lib/python3.11/site-packages/torch/x.py", line 3, in f', "    g()", "RuntimeError: ", "    [Stage 0] failed to run forward:", "    args: ()", "",
             "something printed later"]
    assert root_cause(lines) == "RuntimeError: [Stage 0] failed to run forward: args: ()"
    assert root_cause(["W1123 a warning", "Killed"]) is None
    assert len(root_cause(["Traceback (most recent call last):", "ValueError: " + "x" * 1000])) == ROOT_CAUSE_CHARS


def test_a_rank_killed_by_a_signal_after_warnings_shows_torchruns_exit_line():
    """CI once saw a launch fail with nothing but a rank's warning in its message: the rank printed no
    traceback (a native abort or a kill), and torchrun's summary, which says how it ended, was cut off."""
    lines = ["[rank1]:W1127 03:13:20.734000 12924 torch/distributed/tensor/_redistribute.py:390] While redistributing",
             "Traceback (most recent call last):", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
             "Root Cause (first observed failure):", "[0]:", "  rank      : 3 (local_rank: 3)",
             "  exitcode  : -6 (pid: 21145)", "  error_file: <N/A>",
             "  traceback : Signal 6 (SIGABRT) received by PID 21145"]
    assert root_cause(lines) == ("rank 3 ended by signal 6 (SIGABRT), without a Python traceback (a native abort, "
                                 "or killed)")
    tail = _Run._tail(lines)
    assert tail.splitlines()[0].startswith("[rank1]:W1127")
    assert "exitcode  : -6 (pid: 21145)" in tail and "Signal 6 (SIGABRT) received by PID 21145" in tail


def test_root_cause_points_past_the_no_dropout_mode_to_the_model():
    """Under verify every op passes through autoplan's no-dropout mode: its frame is not the failure's."""
    lines = ["Traceback (most recent call last):",
             '  File "/work/out/model.py", line 17, in forward', "    return self.proj(x)",
             '  File "/venv/site-packages/autoplan/runtime/distributed/dropout.py", line 111, in __torch_function__',
             "    return func(*args, **kwargs)", "IndexError: index 9 is out of bounds"]
    assert root_cause(lines) == "IndexError: index 9 is out of bounds (at /work/out/model.py:17 in forward)"


@pytest.mark.slow
def test_a_failing_pipeline_stage_shows_its_root_cause_first(tmp_path):
    out = tmp_path / "out"
    assert main([str(MODELS / "failing_stage.py"), "--gpus", "2", "--gpu", "cpu", "--global-batch", "4",
                 "--pin", "pp=2", "--out", str(out), "--quiet"]) == 0
    with pytest.raises(UserError) as failure:
        verify(out, VerifySettings(steps=2, timeout_s=240))
    message = str(failure.value).splitlines()
    assert message[0] == "the distributed run (2 processes) failed (exit code 1):"
    assert message[1].startswith("first exception: ValueError: rank-only failure: values out of range in the "
                                 "last block autoplan: at ")
    # train.py runs its folder's copy, by the user's file name
    assert message[1].endswith("out/model_code/failing_stage.py:17 in rank_check)"), message[1]
    # the op, module and model line inside the generated stage code (runtime.failures)
    assert re.search(r"last block autoplan: at autoplan_test\.rank_check\.default in \S+ \(Checked\), pipeline "
                     r"stage 1, from failing_stage\.py:\d+ in forward \(rank 1", message[1]), message[1]
    assert message[2] == "last lines of its stderr:"
