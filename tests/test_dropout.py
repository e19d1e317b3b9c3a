"""Dropout in `autoplan verify`: runtime/distributed/dropout.py NoDropout makes every dropout the identity (eager functions and
modules, attention's dropout_p, the aten ops of an exported pipeline stage, recomputation in backward)
while training without it keeps dropout; verify runs both sides without it (its harness and hook) and says so in its
output, verify.json and the report."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoplan.cli import main
from autoplan.report.html import verify_section
from autoplan.runtime import checkpoint_modules
from autoplan.runtime.distributed.dropout import NoDropout
from autoplan.verify import dropout_handling

MODELS = Path(__file__).parent / "models"


class Dropouts(nn.Module):
    """Every kind of dropout call, each guarded by self.training (so eval mode is the no-dropout answer):
    nn.Dropout, F.dropout, F.dropout2d, sdpa's dropout_p and nn.MultiheadAttention's dropout, twice (6 calls
    with p > 0 in training), plus two that drop nothing (p = 0; alpha dropout, not training by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.fc(x))
        x = F.dropout(x, 0.3, self.training) + F.dropout(x, 0.0, self.training) + F.alpha_dropout(x, 0.5)
        x = F.dropout2d(x.unsqueeze(0), 0.5, self.training).squeeze(0)
        q = x.view(2, 2, 4, 4)
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0).reshape(2, 4, 8)
        return y + self.mha(y, y, y, need_weights=False)[0] + self.mha(y, y, y)[0]


CALLS_PER_FORWARD = 6


def model_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Dropouts(), torch.randn(2, 4, 8)


def without_dropout(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        return model(x).detach()
    finally:
        model.train()


def test_training_keeps_dropout_and_no_dropout_makes_it_the_identity():
    model, x = model_and_input()
    assert not torch.allclose(model(x), model(x))  # dropout draws new masks on every call
    with NoDropout() as switch:
        first, second = model(x), model(x)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, without_dropout(model, x))
    assert switch.calls == 2 * CALLS_PER_FORWARD
    assert not torch.allclose(model(x), model(x))  # and back once the block ends


def test_a_disabled_switch_changes_nothing():
    model, x = model_and_input()
    with NoDropout(enabled=False) as switch:
        assert not torch.allclose(model(x), model(x))
    assert switch.calls == 0


def test_an_exported_graph_runs_its_aten_dropouts_as_the_identity():
    model, x = model_and_input()
    exported = torch.export.export(model, (x,), strict=False).module()  # what a pipeline stage is cut from
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "aten.dropout.default" in targets and "aten.scaled_dot_product_attention.default" in targets
    assert not torch.allclose(exported(x), exported(x))
    with NoDropout() as switch:
        output = exported(x)
    torch.testing.assert_close(output, without_dropout(model, x))
    assert switch.calls == CALLS_PER_FORWARD


def test_native_dropout_returns_a_copy_of_its_input_and_a_full_mask():
    x = torch.randn(4, 4)
    with NoDropout() as switch:
        output, mask = torch.ops.aten.native_dropout.default(x, 0.5, True)
    assert torch.equal(output, x) and output.data_ptr() != x.data_ptr()
    assert mask.dtype == torch.bool and bool(mask.all())
    assert switch.calls == 1


def test_in_place_and_feature_dropouts_leave_their_input_as_it_is():
    x = torch.randn(2, 3, 4)
    with NoDropout() as switch:
        in_place = torch.ops.aten.dropout_.default(x.clone(), 0.5, True)  # its first argument is "self"
        feature = torch.ops.aten.feature_alpha_dropout.default(x, 0.5, True)
        builtin = torch.feature_dropout(x, 0.5, True)
    assert torch.equal(in_place, x) and torch.equal(feature, x) and torch.equal(builtin, x)
    assert switch.calls == 3


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_plans_recomputation_in_backward_runs_without_dropout_too(mode):
    model, x = model_and_input()
    model.eval()
    reference = torch.autograd.grad(model(x).square().sum(), model.fc.weight)[0]
    model.train()
    wrapped = checkpoint_modules(nn.Sequential(model), ["0"], mode)
    with NoDropout() as switch:
        loss = wrapped(x).square().sum()
        gradient = torch.autograd.grad(loss, model.fc.weight)[0]  # the engine runs outside the mode
    torch.testing.assert_close(gradient, reference)
    assert switch.calls == CALLS_PER_FORWARD  # the recomputation's calls are not counted again


@pytest.mark.parametrize("count, says", [(7, "disabled in both runs (7 dropout calls per step)"),
                                         (1, "disabled in both runs (1 dropout call per step)"),
                                         (0, "none in the model")])
def test_verify_words_the_reference_runs_count(tmp_path, count, says):
    path = tmp_path / "dropout.json"
    path.write_text(json.dumps({"disabled_calls_per_step": count}))
    assert dropout_handling(path).startswith(says)


def test_verify_says_when_the_program_did_not_report_dropout(tmp_path):
    assert dropout_handling(tmp_path / "missing.json").startswith("not reported by the reference run")


def test_the_report_shows_how_dropout_was_handled():
    verify = {"nproc": 2, "reference_losses": [1.0, 0.5], "losses": [1.0, 0.5], "parity_max_abs_diff": 0.0,
              "passed": True}
    assert "Dropout:" not in verify_section(verify)
    html = verify_section({**verify, "dropout": "disabled in both runs (<7> dropout calls per step)"})
    assert "Dropout: disabled in both runs (&lt;7&gt; dropout calls per step)." in html


@pytest.mark.slow  # recompute: backward runs the forward again, without dropout too
@pytest.mark.parametrize("pin", ["dp=2", "pp=2,microbatch=2", "dp=2,zero=3,recompute=full",
                                 "pp=2,microbatch=2,recompute=selective"])
def test_a_gpt_with_dropout_passes_verify(tmp_path, capsys, pin):
    out = tmp_path / "out"
    assert main([str(MODELS / "dropout_gpt.py"), "--gpus", "2", "--gpu", "cpu", "--global-batch", "8", "--pin", pin,
                 "--out", str(out), "--quiet"]) == 0
    parallelism = json.loads((out / "plan.json").read_text())["parallelism"]
    assert parallelism["pipeline_parallel_degree"] == (2 if pin.startswith("pp") else 1)
    capsys.readouterr()
    code = main(["verify", str(out), "--steps", "3"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    # embedding + 2 blocks x (attention's dropout_p, F.dropout after the projection, the MLP's nn.Dropout)
    said = "disabled in both runs (7 dropout calls per step)"
    assert f"dropout: {said}" in printed.splitlines()[0]
    report = json.loads((out / "verify.json").read_text())
    assert report["parity_max_abs_diff"] <= 1e-4 and report["dropout"].startswith(said)
    assert f"Dropout: {said}" in (out / "report.html").read_text()


def test_attention_arguments_lose_their_dropout_only_inside_a_no_dropout_block():
    from autoplan.runtime.distributed.dropout import attention_without_dropout

    q = torch.randn(1, 2, 4, 8)
    assert attention_without_dropout((q, q, q), {"dropout_p": 0.1, "is_causal": True}) == \
        ((q, q, q), {"dropout_p": 0.1, "is_causal": True})
    with NoDropout() as switch:
        args, kwargs = attention_without_dropout((q, q, q, None, 0.1), {"is_causal": True})
        assert args[4] == 0.0 and kwargs == {"is_causal": True}
        assert attention_without_dropout((q, q, q), {"dropout_p": 0.1})[1] == {"dropout_p": 0.0}
    assert switch.calls == 0  # the reference run counts
