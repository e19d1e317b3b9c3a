"""train.py --tensorboard (autoplan.runtime.components.tensorboard): the scalars it writes, read back from the event files
with TensorBoard's own reader; the plan's predictions in train.py's PREDICTED; one line and exit 2 when the
package is absent. The last test runs a generated program under torchrun (dp=2, CPU/gloo) in one shared launch
(tests/helpers/batch.py) and checks the event file against the losses and metrics the program also wrote."""

import importlib.util
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training
from autoplan.runtime.components import tensorboard
from autoplan.runtime.components.tensorboard import TensorBoardLog, default_log_dir, predicted_scalars
from helpers.verify_many import BatchJob, run_batch
from test_layouts import TINY_GPT  # examples/gpt.py at tiny sizes

GIB = 2**30
PREDICTION = Prediction(step_time_s=0.05, samples_per_s=160.0, tokens_per_s=1280.0, model_flops_per_step=1e6,
                        mfu=0.1, peak_memory_bytes=3 * GIB)
MEASURED_TAGS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_gib")



def needs_tensorboard():
    """The event-file reader, or a skip that says why (CI installs the package: pyproject's test extra)."""
    return pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                               reason="the tensorboard package is not installed (pip install tensorboard)")


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the event files under log_dir."""
    reader = needs_tensorboard().EventAccumulator(str(log_dir))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def make_plan(model_file: Path) -> Plan:
    par = Parallelism(dp_replicate=2, microbatch=4)
    return Plan(
        model=ModelRef(path=str(model_file)),
        cluster=ClusterRef(gpu="h100-sxm5-80gb", num_gpus=2, gpus_per_node=8, memory_per_gpu_bytes=80 * GIB),
        training=Training(global_batch_size=8, learning_rate=1e-2, seed=3, tokens_per_sample=8),
        parallelism=par,
        stages=(Stage(index=0, modules=("wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"),
                      predicted_time_s=0.05, predicted_memory_bytes=3 * GIB),),
        predicted=PREDICTION,
        solver=SolverInfo(name="pinned", status="optimal", time_s=0.0, candidates_evaluated=1),
    )


def write_gpt_program(root: Path) -> Path:
    model_file = root / "tiny_gpt.py"
    model_file.write_text(TINY_GPT)
    out = root / "out"
    write_program(make_plan(model_file), out, model_file)
    return out


def load_program(out: Path):
    spec = importlib.util.spec_from_file_location("tensorboard_train", out / "train.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    return program


def step_entry(step: int, loss: float) -> dict:
    """A StepMetrics record (runtime/components/metrics.py) as rank 0 has it."""
    return {"step": step, "loss": loss, "seconds": 0.2, "samples_per_s": 40.0, "tokens_per_s": 320.0, "mfu": 0.02,
            "peak_memory_bytes": 2 * GIB}


def test_every_step_writes_the_measured_values_beside_the_predicted_ones(tmp_path):
    needs_tensorboard()
    board = TensorBoardLog(tmp_path / "tb", PREDICTION.__dict__)
    for step, loss in enumerate([2.5, 2.25, 2.0]):
        board.add_step(step_entry(step, loss))
    board.close()
    scalars = read_scalars(tmp_path / "tb")
    assert set(scalars) == {"loss"} | {f"{tag}/{kind}" for tag in MEASURED_TAGS for kind in ("measured", "predicted")}
    assert scalars["loss"] == [(0, 2.5), (1, 2.25), (2, 2.0)]
    measured = {tag: scalars[f"{tag}/measured"] for tag in MEASURED_TAGS}
    assert measured["step_time_s"] == [(s, pytest.approx(0.2)) for s in range(3)]
    assert measured["peak_memory_gib"] == [(s, 2.0) for s in range(3)]  # bytes to GiB
    predicted = {tag: [v for _, v in scalars[f"{tag}/predicted"]] for tag in MEASURED_TAGS}
    assert predicted == {"step_time_s": [pytest.approx(0.05)] * 3, "samples_per_s": [160.0] * 3,
                         "tokens_per_s": [1280.0] * 3, "mfu": [pytest.approx(0.1)] * 3, "peak_memory_gib": [3.0] * 3}


def test_a_value_the_plan_or_the_step_lacks_is_not_written(tmp_path):
    needs_tensorboard()
    board = TensorBoardLog(tmp_path / "tb", {**PREDICTION.__dict__, "tokens_per_s": None})
    entry = step_entry(0, 1.0)
    del entry["mfu"]  # no peak FLOP/s for this GPU: StepMetrics records no MFU
    board.add_step(entry)
    board.close()
    tags = set(read_scalars(tmp_path / "tb"))
    assert "tokens_per_s/predicted" not in tags and "tokens_per_s/measured" in tags
    assert "mfu/measured" not in tags and "mfu/predicted" in tags


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorboard.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tensorboard.dist, "get_rank", lambda: 1)
    needs_tensorboard()
    board = TensorBoardLog(tmp_path / "tb", PREDICTION.__dict__)
    board.add_step(step_entry(0, 1.0))
    board.close()
    assert not (tmp_path / "tb").exists()


def test_predicted_scalars_take_plan_json_names():
    assert predicted_scalars(PREDICTION.__dict__) == {"step_time_s": 0.05, "samples_per_s": 160.0,
                                                      "tokens_per_s": 1280.0, "mfu": 0.1, "peak_memory_gib": 3.0}
    assert predicted_scalars({"step_time_s": None, "mfu": True}) == {}


def test_without_a_folder_it_writes_beside_train_py_one_folder_per_run(tmp_path):
    when = datetime(2026, 11, 24, 3, 4, 5, tzinfo=timezone.utc)
    assert default_log_dir(tmp_path / "train.py", when) == tmp_path.resolve() / "tensorboard" / "20261124-030405"


def test_missing_package_stops_with_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as stopped:
        TensorBoardLog(tmp_path / "tb", {})
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: --tensorboard needs the tensorboard package")
    assert "pip install tensorboard" in err
    TensorBoardLog(None, {})  # not asked for: no check, no exit


def test_generated_program_carries_the_predictions_and_checks_the_package_first(tmp_path, monkeypatch, capsys):
    out = write_gpt_program(tmp_path)
    program = load_program(out)
    assert program.PREDICTED == {"step_time_s": 0.05, "samples_per_s": 160.0, "tokens_per_s": 1280.0, "mfu": 0.1,
                                 "peak_memory_bytes": float(3 * GIB)}
    args = program.parse_args(["--tensorboard"])
    assert args.tensorboard.parent == out.resolve() / "tensorboard"
    assert program.parse_args(["--tensorboard", "runs/a"]).tensorboard == Path("runs/a")
    assert program.parse_args([]).tensorboard is None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit) as stopped:  # before any process group or model: no torchrun needed
        program.main(["--device", "cpu", "--tensorboard", str(tmp_path / "tb")])
    assert stopped.value.code == 2 and "--tensorboard needs the tensorboard package" in capsys.readouterr().err


@pytest.mark.slow
def test_train_py_writes_event_files_that_match_its_losses_and_metrics(tmp_path):
    needs_tensorboard()
    out = write_gpt_program(tmp_path)
    steps = 3
    jobs = [BatchJob(out, ("--device", "cpu", "--steps", str(steps), "--tensorboard", str(tmp_path / "tb"),
                           "--losses-out", str(tmp_path / "losses.json"),
                           "--metrics-out", str(tmp_path / "metrics.json")), world=2),
            BatchJob(out, ("--device", "cpu", "--steps", "1", "--tensorboard"), world=2)]
    errors = run_batch(jobs, nproc=2, timeout_s=600)
    assert errors == ["", ""], next(e for e in errors if e)[-3000:]

    losses = json.loads((tmp_path / "losses.json").read_text())
    history = json.loads((tmp_path / "metrics.json").read_text())["steps"]
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    scalars = read_scalars(tmp_path / "tb")
    assert set(scalars) == {"loss"} | {f"{tag}/{kind}" for tag in MEASURED_TAGS for kind in ("measured", "predicted")}
    assert all([step for step, _ in values] == list(range(steps)) for values in scalars.values())
    assert [v for _, v in scalars["loss"]] == pytest.approx(losses, rel=1e-6)  # float32 in the event file
    assert losses[0] != losses[-1]
    for tag, key, factor in (("step_time_s", "seconds", 1), ("samples_per_s", "samples_per_s", 1),
                             ("tokens_per_s", "tokens_per_s", 1), ("mfu", "mfu", 1),
                             ("peak_memory_gib", "peak_memory_bytes", 1 / GIB)):
        assert [v for _, v in scalars[f"{tag}/measured"]] == pytest.approx(
            [entry[key] * factor for entry in history], rel=1e-6), tag
    assert all(0 < v < 60 for _, v in scalars["step_time_s/measured"])
    assert [v for _, v in scalars["tokens_per_s/measured"]] == pytest.approx(
        [8 * v for _, v in scalars["samples_per_s/measured"]], rel=1e-6)  # 8 tokens per sample
    assert [v for _, v in scalars["step_time_s/predicted"]] == pytest.approx([0.05] * steps)
    assert [v for _, v in scalars["peak_memory_gib/predicted"]] == [3.0] * steps

    runs = list((out / "tensorboard").iterdir())  # --tensorboard without a folder: one run beside train.py
    assert len(runs) == 1 and [s for s, _ in read_scalars(runs[0])["loss"]] == [0]
