"""Checkpoints on disk (autoplan.runtime.components.checkpoint) in one process, without torchrun (DCP's single-process
mode): a save is whole or absent, the newest K are kept, a resume loads the newest checkpoint that loads and
says which (or that there is none, or that nothing is left to train); losses and metrics files grow step by
step (runtime.AppendedJson). tests/test_resume_program.py runs the same through a generated train.py on 2 ranks.
"""

import json
import os
import random
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autoplan.errors import UserError
from autoplan.runtime.components.checkpoint import Checkpointer, first_names
from autoplan.runtime.components.metrics import AppendedJson, write_json


def _checkpointer(directory, keep=3, seed=0) -> Checkpointer:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return Checkpointer(directory, model, torch.optim.AdamW(model.parameters()), keep=keep)


def _weights(checkpointer: Checkpointer) -> torch.Tensor:
    return checkpointer.model.weight.detach().clone()


def _train_and_save(checkpointer: Checkpointer, steps) -> dict[int, torch.Tensor]:
    """One optimizer step before each save; the weights each checkpoint holds."""
    saved = {}
    for step in steps:
        checkpointer.optimizer.zero_grad()
        checkpointer.model(torch.ones(1, 3)).sum().backward()
        checkpointer.optimizer.step()
        checkpointer.save(step)
        saved[step] = _weights(checkpointer)
    return saved


def _damage(step_dir) -> None:
    """Cut every shard of a checkpoint short, as a disk that filled up or a copy that stopped would."""
    for shard in step_dir.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])


def test_saves_keep_the_newest_k_and_leave_no_partial_folder(tmp_path):
    checkpointer = _checkpointer(tmp_path, keep=2)
    _train_and_save(checkpointer, [1, 2, 3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    assert checkpointer.complete_steps() == [3, 2]
    everything = _checkpointer(tmp_path / "all", keep=0)
    _train_and_save(everything, [1, 2, 3])
    assert everything.complete_steps() == [3, 2, 1]


def test_a_save_killed_before_it_completed_is_ignored_and_cleared_by_the_next(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    saved = _train_and_save(checkpointer, [2])
    partial = tmp_path / ".step_4.partial"  # a run killed while writing step 4: shards but no .metadata yet
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"cut")
    fresh = _checkpointer(tmp_path, seed=1)
    assert fresh.latest_step() == 2 and fresh.load() == 2
    assert torch.equal(_weights(fresh), saved[2])
    _train_and_save(fresh, [4])
    assert not partial.exists() and fresh.complete_steps() == [4, 2]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    first = _checkpointer(tmp_path, seed=0)
    _train_and_save(first, [2])
    again = _checkpointer(tmp_path, seed=5)  # a rerun without --resume saves step 2 again
    rerun = _train_and_save(again, [2])
    resumed = _checkpointer(tmp_path, seed=9)
    assert resumed.load() == 2 and torch.equal(_weights(resumed), rerun[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_resume_falls_back_to_the_newest_checkpoint_that_loads_and_says_which(tmp_path, capsys):
    saved = _train_and_save(_checkpointer(tmp_path), [2, 4])
    _damage(tmp_path / "step_4")
    resumed = _checkpointer(tmp_path, seed=1)
    assert resumed.load(6) == 2
    assert torch.equal(_weights(resumed), saved[2])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"resume: loaded {tmp_path / 'step_2'} (2 steps done)"), line
    assert re.search(r"the newest that loads: step_4 did not load \(\w+Error", line), line
    assert line.endswith("; training steps 2 to 5; random generators and data position restored"), line
    assert "\n" not in line


def test_resume_with_no_checkpoint_says_so_and_starts_at_step_0(tmp_path, capsys):
    assert _checkpointer(tmp_path / "typo").load(4) == 0
    assert capsys.readouterr().out.strip() == (f"resume: no checkpoint in {tmp_path / 'typo'} (no step_<k>/ with a "
                                               ".metadata): training from step 0")


def test_resume_at_or_past_the_last_step_says_nothing_is_left_to_train(tmp_path, capsys):
    _train_and_save(_checkpointer(tmp_path), [4])
    assert _checkpointer(tmp_path).load(4) == 4
    line = capsys.readouterr().out.strip()
    assert line == (f"resume: loaded {tmp_path / 'step_4'} (4 steps done); --steps is 4: nothing to train "
                    "(raise --steps to train further)")


def test_resume_when_no_checkpoint_loads_is_one_user_error_naming_each(tmp_path):
    _train_and_save(_checkpointer(tmp_path), [2, 4])
    for step in (2, 4):
        _damage(tmp_path / f"step_{step}")
    with pytest.raises(UserError, match=r"none of the 2 checkpoints in .* loads: step_4 did not load \(.*\); "
                                        r"step_2 did not load"):
        _checkpointer(tmp_path).load(6)


def test_a_negative_retention_count_is_refused(tmp_path):
    with pytest.raises(UserError, match="--keep-checkpoints must be 0 \\(all\\) or more, got -1"):
        _checkpointer(tmp_path, keep=-1)


def test_losses_and_metrics_files_are_valid_json_after_every_step(tmp_path):
    losses, metrics = tmp_path / "losses.json", tmp_path / "metrics.json"
    losses_file, steps_file = AppendedJson(losses), AppendedJson(metrics, {"first_step": 3})
    assert json.loads(losses.read_text()) == [] and json.loads(metrics.read_text()) == {"first_step": 3, "steps": []}
    for step, loss in [(3, 1.25), (4, 0.5)]:
        losses_file.append(loss)
        steps_file.append({"step": step, "loss": loss})
        # as a run killed now would leave them
        assert json.loads(losses.read_text())[-1] == loss
        assert json.loads(metrics.read_text())["steps"][-1] == {"step": step, "loss": loss}
    losses_file.close()
    assert losses.read_text() == json.dumps([1.25, 0.5])
    write_json(metrics, {"done": True})
    assert json.loads(metrics.read_text()) == {"done": True}
    assert sorted(os.listdir(tmp_path)) == ["losses.json", "metrics.json"]  # no partial file left


class TiedModel(nn.Module):
    """An embedding, a linear layer and a head tied to the embedding (two names for one tensor)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(5, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.tok(x))))


def _split_tied(model: TiedModel):
    """The model as two pipeline stages with names of their own, as runtime.split cuts them: stage 0 holds the
    embedding, stage 1 the linear layer and its own copy of the tied head (named by the head's name)."""
    stage0 = nn.ModuleDict({"embed": nn.Embedding(5, 4)})
    stage1 = nn.ModuleDict({"lin": nn.Linear(4, 4), "out": nn.Linear(4, 5, bias=False)})
    with torch.no_grad():
        stage0["embed"].weight.copy_(model.tok.weight)
        stage1["lin"].weight.copy_(model.mid.weight)
        stage1["lin"].bias.copy_(model.mid.bias)
        stage1["out"].weight.copy_(model.tok.weight)
    state_fqns = [{"embed.weight": "tok.weight"},
                  {"lin.weight": "mid.weight", "lin.bias": "mid.bias", "out.weight": "head.weight"}]
    parallel = SimpleNamespace(parts={0: stage0, 1: stage1}, split=SimpleNamespace(state_fqns=state_fqns),
                               model_names=first_names(model), mesh=None)
    return parallel, [stage0["embed"].weight, stage1["lin"].weight, stage1["lin"].bias, stage1["out"].weight]


def _step(optimizer, loss) -> None:
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _model_values(model: TiedModel, optimizer) -> list[torch.Tensor]:
    """tok, mid.weight, mid.bias, head (= tok), each with its AdamW exp_avg."""
    params = [model.tok.weight, model.mid.weight, model.mid.bias, model.head.weight]
    return [t.detach().clone() for p in params for t in (p, optimizer.state[p]["exp_avg"])]


def _stage_values(params, optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for p in params for t in (p, optimizer.state[p]["exp_avg"])]


def test_an_unsplit_checkpoint_resumes_into_pipeline_stages_and_back(tmp_path):
    """Keys are the model's own names whatever the split: a checkpoint of the whole model loads into stages whose
    modules name their tensors otherwise (a tied copy included), and theirs into the whole model (issue 30:
    "Missing key in checkpoint state_dict: model.stage0.tok.weight")."""
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(optimizer, model(torch.tensor([1, 2, 3])).square().sum())
    Checkpointer(tmp_path / "whole", model, optimizer).save(1)

    torch.manual_seed(1)
    parallel, params = _split_tied(TiedModel())
    stage_optimizer = torch.optim.AdamW(params, lr=0.1)
    _step(stage_optimizer, sum(p.square().sum() for p in params))  # other values and optimizer state
    assert Checkpointer(tmp_path / "whole", parallel, stage_optimizer).load() == 1
    for got, want in zip(_stage_values(params, stage_optimizer), _model_values(model, optimizer)):
        assert torch.equal(got, want)

    _step(stage_optimizer, sum(p.square().sum() for p in params))
    Checkpointer(tmp_path / "stages", parallel, stage_optimizer).save(2)
    torch.manual_seed(2)
    whole = TiedModel()
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    _step(whole_optimizer, whole(torch.tensor([0])).sum())
    assert Checkpointer(tmp_path / "stages", whole, whole_optimizer).load() == 2
    # the tied copies: the embedding's stored (on a pipeline TiedGradients keeps the copies equal; here they drifted)
    tied_as_saved = [params[0], params[1], params[2], params[0]]
    for got, want in zip(_model_values(whole, whole_optimizer), _stage_values(tied_as_saved, stage_optimizer)):
        assert torch.equal(got, want)


def test_a_checkpoint_keeps_the_random_generators(tmp_path):
    """What dropout draws after a resume is what it drew after the save (the generators go with a checkpoint)."""
    checkpointer = _checkpointer(tmp_path)
    _train_and_save(checkpointer, [1])
    after_save = (torch.rand(4), random.random())
    torch.manual_seed(123)
    random.seed(123)
    assert _checkpointer(tmp_path, seed=7).load() == 1
    assert torch.equal(torch.rand(4), after_save[0]) and random.random() == after_save[1]


def test_a_checkpoint_of_another_model_is_one_user_error(tmp_path):
    _train_and_save(_checkpointer(tmp_path), [1])
    model = TiedModel()
    with pytest.raises(UserError, match=r"none of the 1 checkpoints in .* loads: step_1 did not load \(.*tok\.weight"):
        Checkpointer(tmp_path, model, torch.optim.AdamW(model.parameters())).load(3)


def test_a_damaged_train_state_passes_the_checkpoint_over(tmp_path, capsys):
    saved = _train_and_save(_checkpointer(tmp_path), [2, 4])
    (tmp_path / "step_4" / "train_state_rank0.pt").write_bytes(b"not a torch file")
    resumed = _checkpointer(tmp_path, seed=1)
    assert resumed.load(6) == 2 and torch.equal(_weights(resumed), saved[2])
    assert "step_4 did not load (ValueError: train_state_rank0.pt: UnpicklingError" in capsys.readouterr().out


def test_under_another_layout_the_generators_are_not_restored_and_the_run_says_so(tmp_path, capsys):
    torch.manual_seed(0)
    model = TiedModel()
    optimizer = torch.optim.AdamW(model.parameters())
    _step(optimizer, model(torch.tensor([1, 2])).sum())
    Checkpointer(tmp_path, model, optimizer).save(1)
    parallel, params = _split_tied(TiedModel())
    parallel.mesh = SimpleNamespace(mesh_dim_names=("pp", "tp"), shape=(1, 1))
    checkpointer = Checkpointer(tmp_path, parallel, torch.optim.AdamW(params))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert checkpointer.load(3) == 1
    assert torch.equal(torch.rand(3), expected)  # the generators as they were, not the checkpoint's
    assert capsys.readouterr().out.strip().endswith(
        "; training steps 1 to 2; saved by another layout (1 process, this run 1 process, mesh pp 1 x tp 1): the "
        "generators start afresh, the data at the step")
