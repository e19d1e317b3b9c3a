"""Tensor parallelism as large-scale programs run it trains like the single-device model: sequence parallel
(plan enable_sequence_parallel, the default with tp > 1), the vocabulary-parallel embedding and head (tied in the
GPT) and the cross-entropy on the sharded logits (loss_parallel), on the from-scratch GPT and HF Llama under
tp=2, dp=2 x tp=2 (DDP and FSDP2) and pp=2 x tp=2, in one 4-process torchrun launch
(tests/helpers/verify_many.py), with the plans of tests/test_layouts.py plus the embedding and head. The
pairs alone with sp on and off, and the gathered-logits fallback (disable_loss_parallel), train alike too.
HF GPT-2 (tied head, Conv1D layers) is planned by the search with the layout pinned, as a user would: its MLP
Conv1D pairs and vocabulary-parallel embedding and head with loss parallel (its fused c_attn keeps the
attention whole and so sequence parallelism off)."""

import json
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.verify import PARITY_TOLERANCE
from helpers.verify_many import verify_many
from test_layouts import LAYOUTS, MODELS, mb, write_case

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

STEPS = 2
TP_LAYOUTS = {
    "tp=2": LAYOUTS["tp=2"],
    "dp=2,tp=2": dict(dp_replicate=2, tp=2, **mb(1, 4)),
    "dp=2,zero=3,tp=2": LAYOUTS["dp=2,zero=3,tp=2"],
    "pp=2,tp=2": LAYOUTS["pp=2,tp=2"],
}
VOCAB = {"gpt": {"wte": "rowwise", "lm_head": "colwise"},
         "llama": {"model.embed_tokens": "rowwise", "lm_head": "colwise"}}
"""The word embedding (rows split on the vocabulary) and the head (logits sharded on it)."""
VARIANTS = {
    "vocab": dict(sp=True),
    "vocab,gathered": dict(sp=True, loss_parallel=False),
    "pairs": dict(sp=True),
    "pairs,sp=off": dict(sp=False),
}
CASES = [(model, layout, variant) for model in MODELS for layout in TP_LAYOUTS for variant in VARIANTS
         if variant == "vocab" or layout == "tp=2"]
GPT2 = '''
"""examples/hf_gpt2.py (HF GPT2LMHeadModel from a config: Conv1D layers, tied head) at tiny sizes, no dropout."""
import importlib.util

_spec = importlib.util.spec_from_file_location("autoplan_example_gpt2", {path!r})
gpt2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt2)
gpt2.VOCAB, gpt2.HIDDEN, gpt2.LAYERS, gpt2.HEADS, gpt2.SEQ_LEN = 64, 16, 2, 2, 8

def build_model():
    return gpt2.build_model(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

example_batch = gpt2.example_batch
loss_fn = gpt2.loss_fn
'''
GPT2_PINS = {"tp=2": 2, "dp=2,zero=0,tp=2": 4, "dp=2,zero=3,tp=2": 4, "pp=2,tp=2": 4}


def _folder(root, model: str, layout: str, variant: str):
    case, parallelism = MODELS[model], dict(TP_LAYOUTS[layout], **VARIANTS[variant])
    pairs = {fqn: style for fqn, style in case.tensor_parallel_plan.items() if fqn not in VOCAB[model]}
    plan = dict(pairs, **(VOCAB[model] if variant.startswith("vocab") else {}))
    modules = case.chain_modules
    half = len(modules) // 2
    stages = [modules] if parallelism.get("pp", 1) == 1 else [modules[:half], modules[half:]]
    return write_case(root, f"{model} {layout} {variant}", case.source, stages, plan, **parallelism)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    folders = [_folder(root, *case) for case in CASES]
    gpt2 = root / "tiny_gpt2.py"
    gpt2.write_text(GPT2.format(path=str(Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2.py")))
    for pin, gpus in GPT2_PINS.items():
        out = root / f"gpt2_{pin.replace(',', '_').replace('=', '')}"
        plan_model(str(gpt2), gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=out))
        folders.append(out)
    batch = verify_many(folders, steps=STEPS, timeout_s=900, nproc=4)
    keys = CASES + [("gpt2", pin) for pin in GPT2_PINS]
    return dict(zip(keys, zip(folders, batch.results)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: ":".join(c))
def test_tensor_parallel_program_trains_like_the_single_device_model(results, case):
    folder, result = results[case]
    config = (folder / "train.py").read_text()
    assert f"SP = {'sp=off' not in case[2]}" in config
    assert f"LOSS_PARALLEL = {'gathered' not in case[2]}" in config
    assert ("'lm_head': 'colwise'" in config) == case[2].startswith("vocab")
    assert not result.error, result.error[-3000:]
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert result.passed and result.gradients.passed, result.gradients  # the first step's gradients too
    assert len(result.losses) == STEPS and result.reference_losses[0] != result.reference_losses[1]
    verify = json.loads((folder / "verify.json").read_text())
    assert verify["parity_max_abs_diff"] == result.parity_max_abs_diff
    assert verify["gradient_max_rel_diff"] == result.gradient_max_rel_diff


@pytest.mark.parametrize("pin", list(GPT2_PINS))
def test_hf_gpt2_conv1d_pairs_and_tied_vocabulary_parallel_head_train_like_the_single_device_model(results, pin):
    folder, result = results["gpt2", pin]
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["tensor_parallel_plan"] == {
        **{f"transformer.h.{i}.mlp.{name}": style for i in range(2) for name, style in
           (("c_fc", "colwise"), ("c_proj", "rowwise"))},
        "lm_head": "colwise", "transformer.wte": "rowwise"}
    assert plan["parallelism"]["disable_loss_parallel"] is False
    assert not result.error, result.error[-3000:]
    assert result.passed and result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
