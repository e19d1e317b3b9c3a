"""Folded expert parallelism (issue 28) on HF OLMoE and HF DeepSeek-V3, tiny configs built from transformers'
classes: `autoplan verify`'s loss and every-gradient parity against the single-device model on CPU/gloo, in one
4-process launch (tests/helpers/verify_many.py), for each model:

- ep over the tp ranks (dp=1 x tp=2 x ep=2), dp x ep x tp (dp=2 x tp=2 x ep=4, FSDP2), pp x ep x tp (pp=2 x tp=2 x
  ep=2) and cp x ep (cp=2 x ep=2), the degrees pinned;
- the search's own plan on 4 ranks (nothing pinned).

DeepSeek-V3 (tests/models/tiny_deepseek_v3.py): multi-head latent attention, a dense first layer
(first_k_dense_replace=1), then MoE layers with a grouped sigmoid router and a shared expert (a colwise/rowwise
Linear pair under tp). Its router multiplies by `self.weight.type(torch.float32)`: a cast of the parameter, not an
activation, so cp is allowed (before, the capture took that matmul for activation x activation attention, which the
ring cannot replace, and refused cp for the model).

Sequence parallelism is refused for both, with its reason (asserted below): their attention is left whole under tp
(OLMoE's q/k norms span every head; DeepSeek-V3's latent projections and their norms span every head), and a whole
attention reads the whole sequence.
"""

import json
from pathlib import Path

import pytest

from autoplan.api import plan_model, profile_only
from autoplan.chain.attention import attention_facts
from autoplan.chain.tensor_parallel import tensor_parallel_facts

from helpers.verify_many import verify_many
from test_expert_parallel_program import SOURCES
from test_layouts import check_parity

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK_V3 = ROOT / "tests" / "models" / "tiny_deepseek_v3.py"
MODELS = {"olmoe": SOURCES["olmoe"], "deepseek_v3": DEEPSEEK_V3.read_text()}
CASES = {f"{model} {pin or 'search'}": (model, pin, gpus) for model in MODELS for pin, gpus in (
    ("dp=1,tp=2,ep=2", 2), ("dp=2,zero=3,tp=2,ep=4", 4), ("pp=2,tp=2,ep=2", 4), ("dp=1,cp=2,ep=2", 2), ("", 4))}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("folded_models")
    paths = {}
    for model, source in MODELS.items():
        paths[model] = root / f"{model}.py"
        paths[model].write_text(source)
    return paths


@pytest.fixture(scope="module")
def batch(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("folded_dsv3_olmoe")
    folders = {}
    for name, (model, pin, gpus) in CASES.items():
        folders[name] = root / name.replace(" ", "_").replace("=", "").replace(",", "_")
        plan_model(str(sources[model]), gpus, "cpu", global_batch=8, pin=pin or None, out=folders[name])
    result = verify_many(list(folders.values()), steps=2, timeout_s=2400, nproc=4)
    return dict(zip(folders, result.results)), folders


@pytest.mark.slow  # one 4-process torchrun launch
@pytest.mark.parametrize("name", list(CASES))
def test_folded_expert_parallel_trains_like_the_single_device_model(batch, name):
    results, folders = batch
    check_parity(results[name])  # the losses and every gradient of the first steps, on every rank
    parallelism = json.loads((folders[name] / "plan.json").read_text())["parallelism"]
    assert parallelism["expert_parallel_degree"] > 1
    pin = CASES[name][1]
    if not pin:
        return
    pins = {key: int(value) for key, value in (item.split("=") for item in pin.split(",") if item != "zero=3")}
    assert parallelism["expert_parallel_degree"] == pins["ep"]
    assert parallelism["tensor_parallel_degree"] == pins.get("tp", 1)
    assert parallelism["pipeline_parallel_degree"] == pins.get("pp", 1)
    assert parallelism["context_parallel_degree"] == pins.get("cp", 1)


def test_deepseek_v3_router_multiplies_by_its_weight_so_context_parallel_is_allowed(sources):
    """The router's `F.linear(x.float(), self.weight.float())`: the matmul reads the parameter through a cast, which
    the capture records as a separate node; it is a matmul by a weight (priced as a GEMM), not attention."""
    profile = profile_only(str(sources["deepseek_v3"]), "h100-sxm5-80gb", measure=False)
    router = [op for op in profile.ops if op.module == "model.layers.1.mlp.gate" and op.op == "aten.linear.default"]
    assert len(router) == 1 and router[0].params == ("model.layers.1.mlp.gate.weight",)
    assert attention_facts(profile).context_parallel_problem == ""


@pytest.mark.parametrize("model", list(MODELS))
def test_sequence_parallelism_is_refused_for_a_whole_attention_with_its_reason(sources, model):
    facts = tensor_parallel_facts(profile_only(str(sources[model]), "h100-sxm5-80gb", measure=False))
    assert "model.layers.0.self_attn" in facts.sequence_parallel_problem
    assert "would read a sequence shard" in facts.sequence_parallel_problem
    whole = {m for block in facts.left_whole for m in block.modules}
    assert "model.layers.0.self_attn.o_proj" in whole  # the attention is left whole: why sp cannot apply
