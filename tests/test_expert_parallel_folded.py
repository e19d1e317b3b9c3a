"""Expert parallelism folded over tensor and context parallelism (issue 28, "MoE parallel folding" as torchtitan and
Megatron-Core run it): the expert mesh is cut from dp_shard x cp x tp, ep spans the tp ranks, each tp rank routes
its own 1/tp of the tokens (without sequence parallelism: its slice of the replicated rows, the outputs all-gathered
after) and the experts' states are FSDP2-sharded over the dp_shard x tp / ep ranks holding the same experts.
Planned by the search with the degrees pinned, then `autoplan verify`'s loss and every-gradient parity against the
single-device model on CPU/gloo, in one 4-process launch (tests/helpers/verify_many.py):

- HF Qwen3-MoE, dp=1 x tp=2 x ep=2 on 2 ranks: the two tp ranks are the ep group (before, ep had to divide dp);
- HF Qwen3-MoE, dp=2 x tp=2 x ep=4 on 4 ranks (zero=3): each rank holds one of the 4 experts;
- HF Mixtral, dp=2 x tp=2 x ep=2 on 4 ranks (zero=3): ep over each tp pair, each expert FSDP2-sharded over the 2
  data-parallel ranks holding it;
- HF Qwen3-MoE, dp=1 x tp=4 x ep=2 on 4 ranks: no FSDP2 (one data-parallel rank), the two tp pairs hold the same
  experts and route different tokens, so their expert gradients are summed after backward;
- HF Qwen3-MoE, cp=2 x ep=2 on 2 ranks and cp=2 x tp=2 x ep=4 on 4: ep folded over the context-parallel ranks,
  which route their own sequence shares (FSDP2 over dp_shard x cp as for the other parameters).

And each rank holds 1/(dp_shard x tp) of the experts, with the single-device model's values (before, the experts
stayed whole on every tp rank: tp times the expert states).
"""

import json
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model

from helpers.verify_many import BatchJob, verify_many
from test_expert_parallel_program import INSPECT
from test_layouts import check_parity

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

ROOT = Path(__file__).resolve().parents[1]
QWEN3_MOE = f"{ROOT}/tests/models/tiny_qwen3.py:build_moe"
MIXTRAL = f"{ROOT}/benchmarks/zoo/causal_lm.py:mixtral_moe"
QWEN3_MOE_4_KV_HEADS = f'''
"""tests/models/tiny_qwen3.py's Qwen3-MoE with 4 key-value heads (tp=4 splits them)."""
import importlib.util

spec = importlib.util.spec_from_file_location("autoplan_folded_qwen3", "{ROOT}/tests/models/tiny_qwen3.py")
qwen3 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qwen3)
qwen3.KV_HEADS = 4
build_model, example_batch, loss_fn = qwen3.build_moe, qwen3.example_batch, qwen3.loss_fn
'''
STEPS = 2
CASES = {
    "qwen3-moe dp=1,tp=2,ep=2": (QWEN3_MOE, "dp=1,tp=2,ep=2", 2),
    "qwen3-moe dp=2,zero=3,tp=2,ep=4": (QWEN3_MOE, "dp=2,zero=3,tp=2,ep=4", 4),
    "mixtral dp=2,zero=3,tp=2,ep=2": (MIXTRAL, "dp=2,zero=3,tp=2,ep=2", 4),
    "qwen3-moe dp=1,tp=4,ep=2": ("qwen3_moe_4_kv_heads.py", "dp=1,tp=4,ep=2", 4),
    "qwen3-moe dp=1,cp=2,ep=2": (QWEN3_MOE, "dp=1,cp=2,ep=2", 2),
    "qwen3-moe dp=1,cp=2,tp=2,ep=4": (QWEN3_MOE, "dp=1,cp=2,tp=2,ep=4", 4),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel_folded")
    folders = {}
    (root / CASES["qwen3-moe dp=1,tp=4,ep=2"][0]).write_text(QWEN3_MOE_4_KV_HEADS)
    for name, (model, pin, gpus) in CASES.items():
        model = model if model.startswith("/") else str(root / model)
        folders[name] = root / name.replace(" ", "_").replace("=", "").replace(",", "_")
        plan_model(model, gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=folders[name]))
    inspect = root / "inspect_experts.py"
    inspect.write_text(INSPECT)
    jobs = [BatchJob(folders[name], (str(folders[name]), str(root / f"experts{i}.json")), gpus, program=inspect)
            for i, (name, (_, _, gpus)) in enumerate(CASES.items())]
    result = verify_many(list(folders.values()), steps=STEPS, timeout_s=1800, nproc=4, extra_jobs=jobs)
    experts = {name: json.loads((root / f"experts{i}.json").read_text()) if not error else error
               for i, (name, error) in enumerate(zip(CASES, result.extra_errors))}
    return dict(zip(folders, result.results)), folders, experts


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_folded_over_tensor_parallel_trains_like_the_single_device_model(batch, name):
    results, folders, _ = batch
    check_parity(results[name])  # the losses and every gradient of the first step, on every rank
    parallelism = json.loads((folders[name] / "plan.json").read_text())["parallelism"]
    pins = {key: int(value) for key, value in (item.split("=") for item in CASES[name][1].split(","))}
    assert parallelism["expert_parallel_degree"] == pins["ep"]
    assert parallelism["data_parallel_shard_degree"] * parallelism["data_parallel_replicate_degree"] == pins["dp"]
    assert parallelism["tensor_parallel_degree"] == pins.get("tp", 1)
    assert parallelism["context_parallel_degree"] == pins.get("cp", 1)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_share_of_the_folded_ranks_experts(batch, name):
    """4 experts per layer over dp_shard x cp x tp ranks: 2 each on 2 ranks, 1 each on 4 (whole experts: ep and
    FSDP2 split them evenly), with the model's own values; without FSDP2 (dp=1 x tp=4) E/ep = 2 each."""
    _, folders, experts = batch
    ranks = experts[name]
    assert isinstance(ranks, list), ranks[-3000:]
    parallelism = json.loads((folders[name] / "plan.json").read_text())["parallelism"]
    folded = parallelism["data_parallel_shard_degree"] * parallelism["context_parallel_degree"] * \
        parallelism["tensor_parallel_degree"]
    if parallelism["data_parallel_shard_degree"] * parallelism["context_parallel_degree"] == 1:
        folded = parallelism["expert_parallel_degree"]  # no FSDP2: each rank holds its E/ep experts whole
    assert len(ranks) == CASES[name][2]
    for rank in ranks:
        assert len(rank) >= 4  # 2 layers x (gate_up_proj, down_proj)
        for entry in rank.values():
            assert entry["global"][0] == 4 and entry["local"][0] == 4 // folded and entry["values"], rank
