"""The output folder (autoplan.api): re-planning into it replaces autoplan's own files and keeps a job's data
(checkpoints, SLURM logs, TensorBoard runs, metrics beside train.py), saying what it kept in one line; what a
killed autoplan left beside it (its hidden staging folder) is removed by the next run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import OWN_FILES, _staged_folder
from autoplan.cli import main

MLP = str(Path(__file__).parent / "models" / "tiny_mlp.py")


def _job_data(out: Path) -> dict[str, str]:
    """What a job run from the plan's folder leaves there (job.sbatch's checkpoints and log, TensorBoard
    runs, a metrics file), by path and contents."""
    files = {"checkpoints/4242/step_2/.metadata": "meta", "checkpoints/4242/step_2/__0_0.distcp": "shard",
             "slurm-4242.out": "step 1 | loss 2.0", "tensorboard/20260101-000000/events.out": "events",
             "metrics.json": "{}", "runs/exp1/log.txt": "mine"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def test_replanning_keeps_the_jobs_data_and_says_so(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([MLP, "--gpus", "2", "--gpu", "cpu", "--pin", "dp=2", "--out", str(out)]) == 0
    capsys.readouterr()
    own = (out / OWN_FILES).read_text().split()
    assert {"plan.json", "train.py", OWN_FILES} <= set(own) and "checkpoints" not in own
    data = _job_data(out)
    (out / "old_report.csv").write_text("a file an earlier plan wrote that this one does not")
    (out / OWN_FILES).write_text((out / OWN_FILES).read_text() + "old_report.csv\n")

    assert main([MLP, "--gpus", "2", "--gpu", "cpu", "--pin", "pp=2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert (f"kept checkpoints/, metrics.json, runs/, slurm-4242.out, tensorboard/ from the previous run in {out}\n"
            in err), err
    assert all((out / name).read_text() == text for name, text in data.items())
    assert json.loads((out / "plan.json").read_text())["parallelism"]["pipeline_parallel_degree"] == 2
    assert not (out / "old_report.csv").exists()  # autoplan's own, not this plan's: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or replaced folder left


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_killed_autoplans_staging_folder_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    dead = _dead_pid()
    left = [tmp_path / f".out.staging-{dead}-x1y2", tmp_path / f".out.old-{dead}"]
    live = tmp_path / f".out.staging-{os.getppid()}-abcd"  # an autoplan still writing (this one's parent)
    other = tmp_path / f".other.staging-{dead}-zz"  # beside another output folder
    for folder in (*left, live, other):
        folder.mkdir()
        (folder / "plan.json").write_text("{}")
    with _staged_folder(out) as staging:
        (staging / "plan.json").write_text("{}")
    assert not any(folder.exists() for folder in left)
    assert live.exists() and other.exists()


def test_an_interrupted_write_leaves_the_previous_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    with _staged_folder(out) as staging:
        (staging / "plan.json").write_text("first")
    (out / "checkpoints").mkdir()
    with pytest.raises(KeyboardInterrupt), _staged_folder(out) as staging:
        (staging / "plan.json").write_text("second")
        raise KeyboardInterrupt
    assert (out / "plan.json").read_text() == "first" and (out / "checkpoints").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
