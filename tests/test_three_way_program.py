"""Context or expert parallelism inside pipeline stages together with tensor parallelism (issue 19): train.py
with cp=2 x tp=2 x pp=2 (HF Llama, 1F1B; the from-scratch GPT with sequence parallelism, GPipe) and with
dp=2 x ep=2 x tp=2 x pp=2 (a tiny examples/mixtral.py, GPipe) trains like the single-device model. Each pair
runs in tests/test_context_parallel_program.py and tests/test_expert_parallel_program.py; the three together
need 8 processes: one 8-process torchrun launch (tests/helpers/verify_many.py)."""

import json

import pytest

from helpers.verify_many import verify_many
from test_expert_parallel_program import ATTENTION_TP_PLAN, SOURCES, STAGES
from test_layouts import check_parity, mb, model_layout, write_case

pytestmark = pytest.mark.slow  # one 8-process torchrun launch

STEPS = 2
LAYOUTS = {
    ("llama", "cp=2,tp=2,pp=2,1f1b"): dict(cp=2, tp=2,
                                           pp=2, schedule="1f1b", **mb(4, 2)),
    ("gpt", "cp=2,tp=2,sp=on,pp=2,gpipe"): dict(cp=2, tp=2,
                                                sp=True, pp=2,
                                                schedule="gpipe", **mb(4, 2)),
}
EXPERT_LAYOUT = ("mixtral", "dp=2,zero=3,ep=2,tp=2,pp=2,gpipe")


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("three_way")
    folders = {key: model_layout(root, *key, layout) for key, layout in LAYOUTS.items()}
    folders[EXPERT_LAYOUT] = write_case(
        root, " ".join(EXPERT_LAYOUT), SOURCES["mixtral"], STAGES[2], ATTENTION_TP_PLAN, dp_shard=2,
        reshard=True, ep=2, tp=2,
        pp=2, schedule="gpipe", **mb(2, 2))
    keys = list(folders)
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=1500, nproc=8)
    return dict(zip(keys, result.results)), folders


@pytest.mark.parametrize("key", [*LAYOUTS, EXPERT_LAYOUT], ids=lambda key: " ".join(key))
def test_three_way_layouts_train_like_the_single_device_model(batch, key):
    results, folders = batch
    check_parity(results[key])
    parallelism = json.loads((folders[key] / "plan.json").read_text())["parallelism"]
    assert (parallelism["pipeline_parallel_degree"], parallelism["tensor_parallel_degree"]) == (2, 2)
    assert parallelism["context_parallel_degree" if key in LAYOUTS else "expert_parallel_degree"] == 2
