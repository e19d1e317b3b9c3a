"""The programs planned with attention split by heads train like the single-device model: HF Qwen3 (per-head
QK-norm, its weights replicated on the tensor-parallel ranks) with sequence parallelism on and off, under FSDP2 and
in a pipeline; Qwen3-MoE (refused before: "no Megatron-style Linear pairs"); a torchtitan-style Llama with complex
rotary embeddings, with and without QK-norm; and models computing their loss inside forward (a nanoGPT look-alike,
HF Qwen3 with labels=) with the vocabulary-parallel head. Planned through plan_model with the layout pinned, as a
user would; checked in one 4-process torchrun launch (tests/helpers/verify_many.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.verify import PARITY_TOLERANCE
from helpers.verify_many import verify_many

pytestmark = pytest.mark.slow  # plans nine models, then one 4-process torchrun launch

MODELS = Path(__file__).parent / "models"
QWEN3 = str(MODELS / "tiny_qwen3.py")
CASES = {
    "qwen3 tp=2": (QWEN3, 2, "tp=2"),
    "qwen3 dp=2,zero=3,tp=2,sp=off": (QWEN3, 4, "dp=2,zero=3,tp=2,sp=off"),
    "qwen3 pp=2,tp=2,sp=off": (QWEN3, 4, "pp=2,tp=2,sp=off"),
    "qwen3 pp=2,tp=2": (QWEN3, 4, "pp=2,tp=2"),
    "qwen3-moe tp=2": (f"{QWEN3}:build_moe", 2, "tp=2"),
    "titan llama tp=2": (str(MODELS / "titan_llama_tp.py"), 2, "tp=2"),
    "titan llama qk-norm tp=2": (f"{MODELS / 'titan_llama_tp.py'}:build_qk_norm", 2, "tp=2"),
    "nanogpt tp=2": (str(MODELS / "nano_gpt_tp.py"), 2, "tp=2"),
    "qwen3 labels= tp=2": (str(MODELS / "qwen3_labels.py"), 2, "tp=2"),
}
ATTENTION = {"qwen3": ("model.layers.1.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
             "titan": ("layers.1.attention", ("wq", "wk", "wv"), "wo")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_attention")
    folders = []
    for name, (model, gpus, pin) in CASES.items():
        out = root / name.replace(" ", "_").replace(",", "_").replace("=", "")
        plan_model(model, gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=out))
        folders.append(out)
    batch = verify_many(folders, steps=2, timeout_s=1200, nproc=4)
    return dict(zip(CASES, zip(folders, batch.results)))


@pytest.mark.parametrize("case", list(CASES))
def test_attention_split_by_heads_trains_like_the_single_device_model(results, case):
    folder, result = results[case]
    plan = json.loads((folder / "plan.json").read_text())
    split = plan["tensor_parallel_plan"]
    family = "titan" if case.startswith("titan") else "qwen3" if case.startswith("qwen3") else None
    if family:
        attention, colwise, rowwise = ATTENTION[family]
        assert {split.get(f"{attention}.{w}") for w in colwise} == {"colwise"}
        assert split.get(f"{attention}.{rowwise}") == "rowwise"
    if family == "qwen3" or "qk-norm" in case:
        norm = "model.layers.1.self_attn.q_norm" if family == "qwen3" else "layers.1.attention.q_norm"
        assert split[norm] == "replicate"
    if case.startswith("nanogpt") or "labels=" in case:  # the loss is computed inside forward
        assert split["lm_head"] == "colwise" and plan["parallelism"]["disable_loss_parallel"] is False
    if case.startswith("nanogpt"):  # its fused c_attn is left whole, and the plan says so
        assert any(b["modules"] == ["transformer.h.0.attn.c_attn"] and "fused" in b["reason"]
                   for b in plan["tensor_parallel_left_whole"])
        assert "Left whole" in (folder / "report.html").read_text()
    assert plan["parallelism"]["enable_sequence_parallel"] == ("sp=off" not in case and "nanogpt" not in case)
    assert not result.error, result.error[-3000:]
    assert result.parity_max_abs_diff <= PARITY_TOLERANCE, (result.reference_losses, result.losses)
    assert result.passed and result.gradients.passed, result.gradients


SPLIT_ATTENTION = {"qwen3 tp=2": "model.layers.{}.self_attn", "titan llama tp=2": "layers.{}.attention",
                   "titan llama qk-norm tp=2": "layers.{}.attention", "qwen3 labels= tp=2": "model.layers.{}.self_attn"}
"""Plans with sequence parallelism whose attention modules must run on each rank's heads."""


def test_split_attention_runs_on_each_ranks_heads_without_gathering_them(results, tmp_path):
    """Forward, each attention module issues exactly its sequence-parallel pair of collectives: one all-gather of
    its input (shared by q, k and v) and the output projection's reduce-scatter; a norm or rotary embedding that
    DTensor could not run on split heads would add an all-gather inside it."""
    out = tmp_path / "collectives.json"
    pairs = [str(arg) for case in SPLIT_ATTENTION for arg in (results[case][0], CASES[case][0])]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).parent / "helpers" / "forward_collectives.py"), str(out), *pairs]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(out.read_text())
    for case, attention in SPLIT_ATTENTION.items():
        collectives = found[str(results[case][0])]
        for layer in range(2):
            assert collectives[attention.format(layer)] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, \
                (case, collectives)
