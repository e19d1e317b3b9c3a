"""train.py's loop beyond forward and backward: the learning-rate schedule (get_lr: linear warmup, cosine decay to
--min-lr at the last step) and gradient clipping (runtime.clip_grad_norm_, what Parallelized.clip_grad_norm_ runs
on each rank: on one process it is torch.nn.utils.clip_grad_norm_). Clipping on every layout is checked by verify
(both runs clip below any norm and the first step's clipped gradients are compared: tests/test_pairs_matrix.py)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from autoplan.runtime import clip_grad_norm_

TEMPLATE = Path(__file__).resolve().parents[1] / "autoplan" / "codegen" / "templates" / "train.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("autoplan_test_train_template", TEMPLATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7)),
              torch.nn.Parameter(torch.randn(2, 2))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    params[2].grad = None  # unused this step
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clipping_on_one_process_is_torchs(max_norm):
    mine, theirs = _params(), _params()
    norm = clip_grad_norm_(mine, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(mine, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_a_tied_copy_counted_elsewhere_is_scaled_but_not_counted():
    params = _params()
    copy = torch.nn.Parameter(params[0].detach().clone())
    copy.grad = params[0].grad.clone()  # a tied weight's second stage holds the same summed gradient
    alone = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    norm = clip_grad_norm_(params + [copy], 0.5, counted_elsewhere=frozenset({id(copy)}))
    assert norm == pytest.approx(alone, rel=1e-6)
    torch.testing.assert_close(copy.grad, params[0].grad)  # both copies scaled alike


def test_zero_measures_without_clipping():
    params = _params()
    before = [p.grad.clone() for p in params if p.grad is not None]
    assert clip_grad_norm_(params, 0.0) > 0
    for a, b in zip([p.grad for p in params if p.grad is not None], before):
        torch.testing.assert_close(a, b)


def test_the_learning_rate_warms_up_then_decays_on_a_cosine_to_the_minimum(train):
    args = train.parse_args(["--steps", "100", "--lr", "1e-3"])
    assert args.warmup_steps == 5 and args.min_lr == pytest.approx(1e-4)
    rates = [train.get_lr(step, args) for step in range(100)]
    assert rates[0] == pytest.approx(1e-3 / 6) and rates[4] == pytest.approx(1e-3 * 5 / 6)
    assert rates[5] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a < b for a, b in zip(rates[:5], rates[1:6]))  # warming up
    assert all(a >= b for a, b in zip(rates[5:], rates[6:]))  # then decaying
    middle = 5 + (99 - 5) / 2
    assert train.get_lr(math.floor(middle), args) == pytest.approx(5.5e-4, rel=0.02)  # halfway down the cosine


def test_short_runs_start_at_the_peak_and_bad_values_are_refused(train, capsys):
    args = train.parse_args(["--steps", "3"])
    assert args.warmup_steps == 0 and train.get_lr(0, args) == pytest.approx(args.lr)
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--clip-grad-norm", "-1"])
    assert exit_info.value.code == 2 and "--clip-grad-norm (-1.0) must be >= 0" in capsys.readouterr().err


def test_a_run_stopped_early_keeps_the_schedule_of_the_whole_run(train):
    whole = train.parse_args(["--steps", "40"])
    first_half = train.parse_args(["--steps", "20", "--decay-steps", "40"])
    assert [train.get_lr(s, first_half) for s in range(20)] == [train.get_lr(s, whole) for s in range(20)]
    assert train.get_lr(60, whole) == pytest.approx(whole.min_lr)  # past the schedule: the minimum
