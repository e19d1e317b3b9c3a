"""Pipelines the program runs (issue 26, item 3): models whose pipeline planned and then failed in the generated
program, planned through the planner (and one cut inside attention written by hand), then trained under torchrun in
one shared launch with loss and first-step gradient parity against the single-device model:
  - a minGPT look-alike whose forward returns (logits, None), pp=2;
  - a torchtitan-style Llama (complex RoPE, transposes around attention, `.view` after them), pp=3 as planned (cut
    inside attention twice) and pp=2 cut just before attention, where the transposed query, key and value cross;
  - a Hugging Face Llama from a plain LlamaConfig (use_cache left True: a DynamicCache in its output), pp=2,tp=2,
    and wrapped in a forward that passes use_cache=True, pp=2 (planning exports it with the cache dropped).
The same checks in one process, fast: tests/test_pipeline_cuts.py."""

from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.codegen import write_program
from autoplan.verify import GRADIENT_TOLERANCE, PARITY_TOLERANCE
from helpers.plans import pinned_plan
from helpers.verify_many import verify_many
from test_pipeline_cuts import load_model_file, titan_chain

pytestmark = pytest.mark.slow  # plans 4 layouts and trains 5 programs under one torchrun launch (~2 min)

MODELS = Path(__file__).parent / "models"
PLANNED = {  # name -> (model file, GPUs, pin)
    "mingpt pp=2": ("loss_inside_gpt.py", 2, "pp=2"),
    "titan pp=3": ("titan_llama.py", 3, "pp=3"),  # the planner cuts before a value projection and attention
    "hf llama use_cache pp=2,tp=2": ("plain_llama.py", 4, "pp=2,tp=2"),
    "hf llama cache forced pp=2": ("plain_llama.py:build_cached", 2, "pp=2"),
}
INSIDE_ATTENTION = "titan pp=2 cut before attention"


def cut_before_attention(root: Path) -> Path:
    """titan_llama at pp=2, stage 1 starting at layer 1's attention call (a hand-written plan)."""
    titan = load_model_file("titan_llama")
    chain = titan_chain(titan)
    cut = chain.index("layers.1.attention.inner_attention")
    model_file = MODELS / "titan_llama.py"
    plan = pinned_plan(model_file, [chain[:cut], chain[cut:]], global_batch=8,
                       pp=2, microbatch=2,
                       microbatches=4)
    out = root / "inside_attention"
    write_program(plan, out, model_file)
    (out / "plan.json").write_text(plan.to_json())
    return out


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuts")
    folders, plans = {}, {}
    for name, (model, gpus, pin) in PLANNED.items():
        folders[name] = root / name.replace(" ", "_").replace(",", "_").replace("=", "")
        plans[name] = plan_model(str(MODELS / model), gpus, "cpu",
                                 PlanOptions(global_batch=8, pin=pin, out=folders[name])).plan
    folders[INSIDE_ATTENTION] = cut_before_attention(root)
    batch = verify_many(list(folders.values()), steps=2, timeout_s=900, nproc=4)
    return plans, dict(zip(folders, batch.results))


@pytest.mark.parametrize("name", [*PLANNED, INSIDE_ATTENTION])
def test_pipeline_trains_with_parity(verified, name):
    plans, results = verified
    if name in plans:
        assert plans[name].parallelism.pp == int(PLANNED[name][2].split(",")[0][3:])
    result = results[name]
    assert not result.error, result.error[-3000:]
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert not result.gradients.problem and result.gradients.max_rel_diff <= GRADIENT_TOLERANCE, result.gradients
    assert result.passed
