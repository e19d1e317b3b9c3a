"""Sequence parallelism (plan enable_sequence_parallel, the default with tp > 1) trains like the single-device
model: the from-scratch GPT (tied head) and HF Llama, under tp=2, dp=2 x tp=2 (DDP and FSDP2) and pp=2 x tp=2,
in one 4-process torchrun launch (tests/helpers/verify_many.py), with the same plans as tests/test_layouts.py.
The same layouts with sp off run too: both programs train alike."""

import json

import pytest

from autoplan.verify import PARITY_TOLERANCE
from helpers.verify_many import verify_many
from test_layouts import LAYOUTS, MODELS, mb, model_layout

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

STEPS = 2
SP_LAYOUTS = {
    "tp=2": LAYOUTS["tp=2"],
    "dp=2,tp=2": dict(data_parallel_replicate_degree=2, tensor_parallel_degree=2, **mb(1, 4)),
    "dp=2,zero=3,tp=2": LAYOUTS["dp=2,zero=3,tp=2"],
    "pp=2,tp=2": LAYOUTS["pp=2,tp=2"],
}
CASES = [(model, layout, sp) for model in MODELS for layout in SP_LAYOUTS for sp in (True, False)
         if sp or layout == "tp=2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    folders = [model_layout(root, model, f"{layout} sp={sp}", dict(SP_LAYOUTS[layout], enable_sequence_parallel=sp))
               for model, layout, sp in CASES]
    batch = verify_many(folders, steps=STEPS, timeout_s=600, nproc=4)
    return dict(zip(CASES, zip(folders, batch.results)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}:{c[1]}:sp={'on' if c[2] else 'off'}")
def test_sequence_parallel_trains_like_the_single_device_model(results, case):
    folder, result = results[case]
    assert f"SP = {'on' if case[2] else 'off'!r}" in (folder / "train.py").read_text()
    assert not result.error, result.error[-3000:]
    assert result.passed and result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert len(result.losses) == STEPS and result.reference_losses[0] != result.reference_losses[1]
    verify = json.loads((folder / "verify.json").read_text())
    assert verify["parity_max_abs_diff"] == result.parity_max_abs_diff
