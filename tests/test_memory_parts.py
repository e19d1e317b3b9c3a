"""The plan's memory, part by part, against what `autoplan verify --measure` finds the peak held on CPU
(PeakLiveMemory.peak_parts: parameters, gradients, optimizer state, buffers, activations), for FSDP, tensor and
pipeline parallel layouts of a small GPT. Slow: one verify launch per layout."""

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODEL = f"""import sys, torch
sys.path.insert(0, {str(EXAMPLES)!r})
from gpt import GPT, loss_fn
def build_model():
    return GPT(256, 512, 2, 2, 64)
def example_batch(batch_size):
    idx = torch.randint(0, 256, (batch_size, 513))
    return idx[:, :-1], idx[:, 1:]
"""
LAYOUTS = {
    # one micro-batch per rank: FSDP2's sharded gradients are made in backward, none alive at the loss's peak
    "fsdp": "dp=2,zero=3,microbatch=2,recompute=none",
    # one micro-batch, no data parallelism: autograd's .grad made in backward (was priced as held at the peak)
    "tp": "dp=1,tp=2,microbatch=4,recompute=none",
    # a pipeline accumulates: the gradients exist from the first micro-batch's backward on
    "pp": "dp=1,pp=2,microbatch=1,recompute=none,schedule=1f1b",
}
ACTIVATIONS_TOLERANCE = 0.15
"""Measured here (predicted vs measured): activations -8.7% (tp), -6% (fsdp, with the gathered units); pp +7.5% on
the first stage, -5.9% on the last (cut after blocks.1.ln_1), +8.3% and -0.3% with the cut one module earlier (after
blocks.0.mlp). Before the program's receive buffers were made on demand and the last stage's kept logits priced
(runtime/steps.py, cost/memory.py), the last stage was -29% (-19% with the earlier cut)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_part_of_the_peak_is_priced_as_measured(tmp_path, name):
    from autoplan.api import plan_model
    from autoplan.verify import verify

    model = tmp_path / "gpt_small.py"
    model.write_text(MODEL)
    out = tmp_path / "out"
    # op times from the roofline: timed on this machine, they move the pipeline's cut from run to run (the CI saw the
    # last stage start at blocks.1.attn in one run and at blocks.1.ln_1 in the next), changing what each stage holds
    plan_model(str(model), 2, "cpu", global_batch=4, pin=LAYOUTS[name], out=out, measure=False)
    assert verify(out, steps=2, timeout_s=400, measure=True).passed
    for rank in json.loads((out / "verify.json").read_text())["ranks"]:
        measured, predicted = rank["measured_peak_memory_parts"], rank["predicted_peak_memory_parts"]
        assert measured["gradients"] == pytest.approx(predicted["gradients"], rel=0.01, abs=1024), (measured, predicted)
        assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.01), (measured, predicted)
        if name == "fsdp":  # the shards, and at most the gathered units priced in flight
            assert 0 < measured["parameters"] <= predicted["parameters"]
            assert (measured["parameters"] + measured["activations"]
                    == pytest.approx(predicted["parameters"] + predicted["activations"], rel=ACTIVATIONS_TOLERANCE))
        else:
            assert measured["parameters"] == pytest.approx(predicted["parameters"], rel=0.01)
            assert measured["activations"] == pytest.approx(predicted["activations"], rel=ACTIVATIONS_TOLERANCE)
