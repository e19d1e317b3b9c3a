"""A generated train.py (FSDP2, 2 CPU ranks) saving, damaging and resuming checkpoints, in ONE torchrun launch
(tests/helpers/verify_many.py run_batch, every job on the same two ranks, one after the other):

- a run with a checkpoint every step keeps the newest two (--keep-checkpoints 2);
- its newest checkpoint damaged, --resume falls back to the one before and continues the uninterrupted losses;
- a checkpoint at --steps: --resume trains nothing and writes [] (it says so: tests/test_checkpoint_files.py);
- --resume with no checkpoint starts at step 0;
- a run that dies after two steps has written their losses and metrics (per step, not at the end).
"""

import json
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from helpers.plans import pinned_plan
from helpers.verify_many import BatchJob, run_batch

pytestmark = pytest.mark.slow  # one 2-process torchrun launch

MODEL = '''
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

def example_batch(batch_size):
    return torch.randn(batch_size, 6), torch.randn(batch_size, 3)
'''

DAMAGE = '''
"""Cut the shards of the checkpoint folder argv[0] short (rank 0), as a disk that filled up would."""
from pathlib import Path
import torch.distributed as dist

def main(argv):
    if dist.get_rank() == 0:
        for shard in Path(argv[0]).glob("*.distcp"):
            shard.write_bytes(shard.read_bytes()[:10])
    dist.barrier()
'''

DIES_AFTER_TWO_STEPS = '''
"""Run train.py (argv[0]) with argv[1:], every rank raising in its third step's metrics, as a killed run stops."""
import importlib.util

def main(argv):
    spec = importlib.util.spec_from_file_location("train_dies_after_two_steps", argv[0])
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    metrics = program.runtime.StepMetrics
    record = metrics.record

    def record_two(self, *args, **kwargs):
        if len(self.history) == 2:
            raise RuntimeError("killed in step 2")
        return record(self, *args, **kwargs)

    metrics.record = record_two
    try:
        program.main(argv[1:])
    finally:
        metrics.record = record
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model_file = root / "model.py"
    model_file.write_text(MODEL)
    out = root / "out"
    plan = pinned_plan(model_file, [("0", "1", "2")], dp_shard=2,
                       microbatches=1, microbatch=4)
    write_program(plan, out, model_file)
    (out / "plan.json").write_text(plan.to_json())
    for name, text in (("damage.py", DAMAGE), ("dies.py", DIES_AFTER_TWO_STEPS)):
        (root / name).write_text(text)
    checkpoints, empty = root / "checkpoints", root / "no_checkpoints"
    common = ("--device", "cpu", "--steps", "4")
    resume = (*common, "--checkpoint-dir", str(checkpoints), "--resume")
    jobs = [BatchJob(out, (*common, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1",
                           "--keep-checkpoints", "2", "--losses-out", str(root / "uninterrupted.json")), 2)]
    later = [
        BatchJob(out, (str(checkpoints / "step_4"),), 2, program=root / "damage.py"),
        BatchJob(out, (*resume, "--losses-out", str(root / "fell_back.json"), "--metrics-out",
                       str(root / "fell_back_metrics.json")), 2),
        BatchJob(out, (*resume, "--losses-out", str(root / "nothing_left.json")), 2),
        BatchJob(out, ("--device", "cpu", "--steps", "2", "--decay-steps", "4", "--checkpoint-dir", str(empty), "--resume",
                       "--losses-out", str(root / "from_scratch.json")), 2),
        BatchJob(out, (str(out / "train.py"), *common, "--losses-out", str(root / "died.json"), "--metrics-out",
                       str(root / "died_metrics.json")), 2, program=root / "dies.py"),
    ]
    jobs += [BatchJob(job.out_dir, job.argv, job.world, same_ranks_as=i, program=job.program)
             for i, job in enumerate(later)]
    errors = run_batch(jobs, nproc=2, timeout_s=600)
    return root, errors


def _losses(root: Path, name: str) -> list[float]:
    return json.loads((root / f"{name}.json").read_text())


def test_the_newest_checkpoints_are_kept_and_a_damaged_one_is_passed_over(runs):
    root, errors = runs
    assert not any(errors[:3]), next(e for e in errors[:3] if e)[-3000:]
    uninterrupted = _losses(root, "uninterrupted")
    assert len(uninterrupted) == 4
    # kept the newest two (step_3, step_4); step_4 damaged: resumed from step_3, step 3 again, saved step_4 anew
    assert _losses(root, "fell_back") == uninterrupted[3:]
    assert json.loads((root / "fell_back_metrics.json").read_text())["first_step"] == 3
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_3", "step_4"]


def test_resume_at_the_last_step_trains_nothing_and_without_a_checkpoint_from_step_0(runs):
    root, errors = runs
    assert not errors[3] and not errors[4], (errors[3] or errors[4])[-3000:]
    assert _losses(root, "nothing_left") == []
    assert _losses(root, "from_scratch") == _losses(root, "uninterrupted")[:2]


def test_a_run_that_dies_keeps_the_losses_and_metrics_of_its_finished_steps(runs):
    root, errors = runs
    assert "killed in step 2" in errors[5], errors[5][-3000:]
    assert _losses(root, "died") == _losses(root, "uninterrupted")[:2]
    metrics = json.loads((root / "died_metrics.json").read_text())
    assert metrics["first_step"] == 0 and [entry["step"] for entry in metrics["steps"]] == [0, 1]
