"""The planner finds, before any program runs, a loss_fn that cannot run on the vocabulary-parallel head's
sharded logits (profile/loss_probe.py): the plan gathers them (disable_loss_parallel), prices that, and says
why; a cross-entropy keeps loss parallel on."""

from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.profile.loss_probe import loss_parallel_problem
from autoplan.contract import load_source

ROOT = Path(__file__).resolve().parents[1]
SMOOTHED = Path(__file__).resolve().parent / "models" / "smoothed_gpt.py"


@pytest.mark.parametrize("spec", ["examples/gpt.py", "examples/llama.py", "examples/hf_gpt2.py"])
def test_cross_entropy_runs_on_sharded_logits(spec):
    assert loss_parallel_problem(load_source(str(ROOT / spec)), 2) == ""


def test_hand_written_label_smoothing_is_found_and_named():
    problem = loss_parallel_problem(load_source(str(SMOOTHED)), 2)
    assert problem.startswith("loss_fn applies aten.gather to the logits"), problem


def test_the_plan_gathers_the_logits_and_says_why():
    smoothed = plan_model(str(SMOOTHED), 8, "h100-sxm5-80gb", PlanOptions(pin="tp=2"))
    plain = plan_model(str(ROOT / "examples" / "gpt.py"), 8, "h100-sxm5-80gb", PlanOptions(pin="tp=2"))
    assert not smoothed.plan.parallelism.loss_parallel
    assert plain.plan.parallelism.loss_parallel
    assert any(line.startswith("no loss parallel") and "aten.gather" in line for line in smoothed.not_planned)
    assert not any(line.startswith("no loss parallel") for line in plain.not_planned)
    # priced as run: every rank holds the gathered logits whole (one all-gather replaces three all-reduces of
    # a number per token, which on this small model is the cheaper of the two)
    assert smoothed.plan.parallelism == plain.plan.parallelism.__class__(
        **{**plain.plan.parallelism.__dict__, "loss_parallel": False})
    assert smoothed.plan.predicted.peak_memory_bytes > plain.plan.predicted.peak_memory_bytes


CLASSIFIER = Path(__file__).resolve().parent / "models" / "sequence_classifier.py"


def test_targets_without_the_sequence_refuse_context_parallelism_at_planning():
    from autoplan.errors import UserError
    from autoplan.profile.loss_probe import sequence_targets_problem

    assert sequence_targets_problem(load_source(str(ROOT / "examples" / "llama.py")), 2) == ""
    problem = sequence_targets_problem(load_source(str(CLASSIFIER)), 2)
    assert problem.startswith("the targets have no dimension of the sequence's 16 tokens at position 1 (shapes [(2,)])")
    with pytest.raises(UserError, match="cp=2: the targets have no dimension of the sequence's 16 tokens"):
        plan_model(str(CLASSIFIER), 2, "h100-sxm5-80gb", PlanOptions(pin="cp=2"))
    assert plan_model(str(CLASSIFIER), 2, "h100-sxm5-80gb").plan.parallelism.cp == 1


def test_the_probe_runs_each_run_of_identical_blocks_cut_short():
    """A deep model's probe runs the first few of its identical blocks, as the capture traces them (the 1T GPT's
    128 blocks were a sixth of its CLI run): the same logits reach the loss_fn, so the same answer."""
    from dataclasses import replace

    from autoplan.capture.repeats import KEPT_BLOCKS, find_runs

    source = load_source(str(ROOT / "examples" / "gpt.py"))
    layers, calls = 12, []

    def deep():
        model = source.module.GPT(n_layer=layers)
        for block in model.blocks:
            block.register_forward_pre_hook(lambda module, args: calls.append(module))
        return model

    assert len(find_runs(source.module.GPT(n_layer=layers))) == 1
    assert loss_parallel_problem(replace(source, build_model=deep), 2) == ""
    assert len(calls) == KEPT_BLOCKS < layers
    smoothed = load_source(str(SMOOTHED))
    deep_smoothed = replace(smoothed, build_model=lambda: smoothed.module.gpt.GPT(n_layer=layers))
    assert loss_parallel_problem(deep_smoothed, 2).startswith("loss_fn applies aten.gather to the logits")
