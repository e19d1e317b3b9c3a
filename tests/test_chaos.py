"""benchmarks/chaos.py's logic once, on the data-parallel layout: one rank killed with SIGKILL while the program runs
under its own launch/torchrun.sh, torchrun restarts it, train.py resumes from the newest checkpoint, and the final
per-step losses equal the uninterrupted run's bit for bit (issue 30). The full benchmark covers the other layouts
and dropout."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def chaos_module():
    spec = importlib.util.spec_from_file_location("autoplan_chaos_benchmark", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_metrics_of_an_attempt_are_read_while_it_writes_them(tmp_path):
    chaos = chaos_module()
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"first_step": 4, "steps": [{"step": 4, "loss": 1.5}, {"step": 5, "loss": 1.25}]}))
    attempt = chaos.read_metrics(path)
    assert (attempt.first_step, attempt.losses) == (4, {4: 1.5, 5: 1.25})
    path.write_text('{"first_step": 4, "steps": [{"step": 4, "lo')  # caught mid-append
    assert chaos.read_metrics(path) is None
    assert chaos.partial_checkpoint(tmp_path) == ""
    (tmp_path / ".step_8.partial").mkdir()
    assert chaos.partial_checkpoint(tmp_path) == ".step_8.partial"
    kill = chaos.Kill(kind="step", rank=1, at_step=11, resumed_from=8)
    assert kill.steps_lost == 3


@pytest.mark.slow  # three 2-process torchrun starts (~1-3 min here)
def test_a_killed_rank_costs_steps_not_losses(tmp_path):
    chaos = chaos_module()
    rows_file = tmp_path / "rows.json"
    code = chaos.main(["--layouts", "dp", "--kills", "1", "--dropout", "off", "--steps", "12", "--checkpoint-every",
                       "4", "--seed", "1", "--work", str(tmp_path / "work"), "--json", str(rows_file)])
    (row,) = json.loads(rows_file.read_text())
    assert code == 0 and row["identical"] and row["exit_code"] == 0, row
    assert row["missing_steps"] == 0 and row["max_abs_diff"] == 0.0 and row["replayed_steps_identical"], row
    (lost,) = row["steps_lost"]
    assert lost is not None and 0 <= lost <= 4, row  # at most one checkpoint interval
