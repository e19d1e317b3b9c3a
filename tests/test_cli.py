"""The command line: bad input (one clear line on stderr, exit code 2, no output folder), --help,
--version, and no solver banner in a real process's output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli import main

MODELS = Path(__file__).parent / "models"
MLP = str(MODELS / "tiny_mlp.py")


@pytest.mark.parametrize("args, message", [
    ([MLP, "--gpus", "0"], "--gpus must be a positive integer, got '0'"),
    ([MLP, "--gpus", "two"], "--gpus must be a positive integer"),
    ([MLP, "--gpus", "2", "--gpu", "tpu-v9"], "tpu-v9"),
    ([MLP, "--gpus", "2", "--memory-per-gpu", "lots"], "cannot read memory size 'lots'"),
    ([MLP, "--gpus", "2", "--pin", "warp=9"], "warp"),
    ([MLP, "--gpus", "4", "--gpu", "cpu", "--pin", "pp=3"], "3"),
    ([MLP, "--gpus", "4", "--gpu", "cpu", "--pin", "pp=2", "--pin", "pp=4"], "'pp' is given twice"),
    ([MLP, "--gpus", "2", "--dtype", "fp8"], "--dtype must be bf16 or fp32"),
    (["/no/such/model.py", "--gpus", "2"], "model file not found"),
    ([MLP], "--gpus"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_repeated_pins_all_apply(tmp_path):
    out = tmp_path / "out"
    assert main([MLP, "--gpus", "4", "--gpu", "cpu", "--pin", "pp=2", "--pin", "dp=2,zero=3", "--out", str(out)]) == 0
    parallelism = json.loads((out / "plan.json").read_text())["parallelism"]
    assert parallelism["pipeline_parallel_degree"] == 2 and parallelism["data_parallel_shard_degree"] == 2


def test_several_errors_are_reported_together(tmp_path, capsys):
    assert main([MLP, "--gpus", "-1", "--memory-per-gpu", "x", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--gpus" in err and "memory size" in err


def test_real_process_exit_code_and_single_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "autoplan", MLP, "--gpus", "nope", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "positive integer" in run.stderr
    assert not (tmp_path / "o").exists()


def test_verify_of_a_folder_without_a_plan(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "plan.json" in capsys.readouterr().err


def test_logs_go_to_the_stderr_of_the_moment_not_the_first_calls(tmp_path, monkeypatch):
    """main() run in-process configures logging; a later log line (another test, a notebook cell) must not be
    written to the stream that was sys.stderr then and is closed now (CI printed "--- Logging error ---")."""
    import io
    import logging

    first, later = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert main(["verify", str(tmp_path)]) == 2
    first.close()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("autoplan.test").warning("after the first stream closed")
    assert later.getvalue() == "autoplan: after the first stream closed\n"


SLOW_MODEL = """
import pathlib, time, torch
def build_model():
    pathlib.Path(__file__).with_suffix('.started').write_text('1')
    time.sleep(60)
    return torch.nn.Linear(2, 2)
def example_batch(batch_size):
    return torch.randn(batch_size, 2), torch.randn(batch_size, 2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_interrupted_run_leaves_nothing_and_exits_130_or_143(tmp_path, signal_name, code):
    import signal
    import time

    model = tmp_path / "slow.py"
    model.write_text(SLOW_MODEL)
    out = tmp_path / "out"
    # a shell's background job inherits SIGINT ignored (and Python then keeps it ignored): as from a terminal
    proc = subprocess.Popen([sys.executable, "-m", "autoplan", str(model), "--gpus", "2", "--gpu", "cpu",
                             "--out", str(out)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 90
    while not model.with_suffix(".started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.1)
    proc.send_signal(getattr(signal, signal_name))
    assert proc.wait(timeout=30) == code
    assert "Traceback" not in proc.stderr.read()
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["slow.py", "slow.started"]


def test_help_is_user_help_with_subcommands_options_profiles_and_exit_codes(capsys):
    from autoplan.hardware.profiles import known_hardware

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "thin over autoplan.api" not in text
    for word in ("plan MODEL.py", "profile MODEL.py", "verify DIR", "calibrate --out", "--gpus N", "--pin",
                 "--memory-per-gpu", "--out DIR", "--version", "exit codes: 0 success; 2 bad input"):
        assert word in text, word
    names = known_hardware()
    assert "h100-sxm5-80gb" in names and all(name in text for name in names)
    gpus_per_node = text[text.index("--gpus-per-node K"):text.index("--global-batch")]
    assert "GPUs per node" in gpus_per_node
    assert main(["-h"]) == 0 and capsys.readouterr().out == text


def test_no_arguments_prints_the_help_on_stderr_and_exits_2(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "subcommands:" in captured.err and "exit codes" in captured.err


def test_version_names_the_package_version(capsys):
    import autoplan

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"autoplan {autoplan.__version__}\n"


def test_solver_prints_no_banner_in_a_real_process(tmp_path):
    """pp=2 sends the stage split to the MILP; HiGHS writes its banner from C to fd 1 unless silenced."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "autoplan", MLP, "--gpus", "4", "--pin", "pp=2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    solver = json.loads((out / "plan.json").read_text())["solver"]
    assert solver["time_s"] > 0  # the MILP ran (a single stage skips it with time 0)
    for text in (run.stdout, run.stderr):
        assert "Running HiGHS" not in text and "Copyright" not in text and "Welcome to the CBC" not in text


def test_the_summary_suggests_verify_only_for_a_plan_this_machine_can_run():
    from dataclasses import replace

    from rich.console import Console

    from autoplan.api import plan_model
    from autoplan.cli import summary

    def text(plan) -> str:
        console = Console(width=200, record=True)
        console.print(summary(plan, "out"))
        return console.export_text()

    small = plan_model(MLP, 2, "h100-sxm5-80gb").plan
    assert "check it: autoplan verify out" in text(small)
    large = replace(small, cluster=replace(small.cluster, num_gpus=64),
                    model=replace(small.model, param_count=70_000_000_000))
    hint = text(large)
    assert "autoplan verify out" not in hint
    assert "too large to check on this machine's CPU (64 processes, 260.8 GiB of fp32 weights)" in hint
