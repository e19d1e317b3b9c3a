"""Megatron pairs found in real captures (examples/gpt.py, HF Llama, a Megatron-style GPT), the
divisibility facts search checks tp against, and what the search does with them."""

from dataclasses import replace
from pathlib import Path

import pytest
from chain_fixtures import cluster, gpt_profile

from autoplan.chain.tensor_parallel import find_tensor_parallel_plan, tensor_parallel_facts
from autoplan.errors import UserError
from autoplan.layout import SUPPORTED, Layout
from autoplan.plan import Training
from autoplan.profile_data import ModelProfile
from autoplan.solve.search import SearchOptions, search

FIXTURES = Path(__file__).parent / "fixtures"
MEGATRON_TP = SUPPORTED | {"tp_fused_split"}
"""The synthetic GPT fuses q, k and v in one Linear: its attention is tensor-parallel as in Megatron-LM."""


def _capture(name: str) -> ModelProfile:
    return ModelProfile.from_json((FIXTURES / f"{name}_capture.json").read_text())


@pytest.mark.parametrize("name", ["gpt", "megatron_gpt"])
def test_gpt_pairs_qkv_with_proj_and_fc_with_proj(name):
    plan = find_tensor_parallel_plan(_capture(name), vocab_parallel=False)
    expected = {}
    for i in range(2):
        expected |= {f"blocks.{i}.attn.qkv": "colwise", f"blocks.{i}.attn.proj": "rowwise",
                     f"blocks.{i}.mlp.fc": "colwise", f"blocks.{i}.mlp.proj": "rowwise"}
    assert plan == expected


def test_llama_pairs_qkv_with_o_proj_through_rotary_and_gqa_and_gate_up_with_down():
    facts = tensor_parallel_facts(_capture("llama"))
    layer = "model.layers.0"
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert facts.plan[f"{layer}.{proj}"] == "colwise"
    assert facts.plan[f"{layer}.self_attn.o_proj"] == facts.plan[f"{layer}.mlp.down_proj"] == "rowwise"
    assert facts.plan["lm_head"] == "colwise" and facts.plan["model.embed_tokens"] == "rowwise"
    sizes = {f.size for f in facts.divisibility}
    assert {4, 2} <= sizes  # 4 query heads, 2 key/value heads (GQA)
    assert facts.problems(2) == [] and facts.problems(4)
    assert any("2 attention heads" in p for p in facts.problems(4))


def test_vocab_parallel_head_is_tied_with_the_word_embedding_not_the_positions():
    facts = tensor_parallel_facts(_capture("gpt"))
    assert facts.plan["lm_head"] == "colwise" and facts.plan["wte"] == "rowwise" and "wpe" not in facts.plan
    assert "wte.weight" in facts.sharded_parameters and "wpe.weight" not in facts.sharded_parameters
    assert "blocks.0.attn.proj.bias" not in facts.sharded_parameters  # rowwise bias is added once, whole
    assert "blocks.0.attn.qkv.bias" in facts.sharded_parameters


def test_divisibility_names_heads_and_features():
    facts = tensor_parallel_facts(gpt_profile(n_layer=2, n_embd=96, vocab=120, seq=8, n_head=6))
    assert facts.problems(3) == []
    problems = facts.problems(4)
    assert any("6 attention heads (blocks.0.attn)" in p for p in problems)
    assert any("vocabulary 120" not in p for p in problems) and facts.problems(1) == []


def test_a_residual_joining_a_split_tensor_drops_the_pair():
    profile = gpt_profile(n_layer=2)
    ops = list(profile.ops)
    at = next(i for i, op in enumerate(ops) if op.node == "transpose_out_1")
    ops[at] = replace(ops[at], op="aten.add.Tensor", inputs=("sdpa_1", "res2_0"))  # block 0's output joins
    plan = find_tensor_parallel_plan(replace(profile, ops=tuple(ops)), vocab_parallel=False)
    assert "blocks.1.attn.qkv" not in plan and "blocks.1.attn.proj" not in plan
    assert plan["blocks.1.mlp.fc"] == "colwise" and plan["blocks.0.attn.qkv"] == "colwise"


def test_no_pairs_means_no_tensor_parallelism():
    profile = gpt_profile(n_layer=2)
    mlp_only = replace(profile, ops=tuple(op for op in profile.ops if "linear" not in op.op or op.node == "lm_head"))
    facts = tensor_parallel_facts(mlp_only, vocab_parallel=False)
    assert facts.plan == {} and "no Megatron-style Linear pairs" in facts.problems(2)[0]


def test_pinned_tp_that_does_not_divide_the_heads_says_so():
    profile = gpt_profile(n_layer=8, n_embd=96, vocab=128, seq=32, n_head=6)
    with pytest.raises(UserError, match="tp=4 does not divide 6 attention heads"):
        search(profile, cluster(8), Training(global_batch_size=8), Layout(tp=4),
               options=SearchOptions(features=MEGATRON_TP))


def test_tensor_parallel_stays_inside_a_node_and_the_plan_names_the_pairs():
    profile = gpt_profile(n_layer=12, n_embd=1024, vocab=8192, seq=512, n_head=16, device="testgpu")
    tight = replace(cluster(16, gpus_per_node=4), memory_per_gpu_bytes=None)
    result = search(profile, tight, Training(global_batch_size=16, dtype="bf16"),
                    options=SearchOptions(features=MEGATRON_TP))
    assert all(c.parallelism.tp <= 4 for c in result.candidates)
    pinned = search(profile, tight, Training(global_batch_size=16, dtype="bf16"), Layout(tp=4, pp=1),
                    options=SearchOptions(features=MEGATRON_TP))
    assert pinned.best.tensor_parallel_plan["blocks.0.attn.qkv"] == "colwise"
    assert pinned.best.tensor_parallel_plan["blocks.11.mlp.proj"] == "rowwise"
    with pytest.raises(UserError, match="tp=8"):
        search(profile, tight, Training(global_batch_size=16, dtype="bf16"), Layout(tp=8))


def test_a_fused_qkv_split_is_not_sharded_where_torch_tp_would_gather_it():
    """examples/gpt.py splits one qkv Linear's output: torch's ColwiseParallel cannot keep that split
    sharded (DTensor all-gathers it), so the program's layouts tensor-parallelize the MLP only; pricing
    Megatron-LM (interleaved weights) keeps the attention pair."""
    capture = _capture("gpt")
    plan = find_tensor_parallel_plan(capture, vocab_parallel=False, fused_split=False)
    assert plan == {f"blocks.{i}.mlp.{name}": style for i in range(2)
                    for name, style in (("fc", "colwise"), ("proj", "rowwise"))}
    llama = tensor_parallel_facts(_capture("llama"), fused_split=False).plan  # separate q/k/v: unchanged
    assert llama == tensor_parallel_facts(_capture("llama")).plan


def test_sequence_parallel_runs_between_the_pairs_where_every_op_is_per_token():
    llama = tensor_parallel_facts(_capture("llama"), fused_split=False)
    assert llama.sequence_parallel_problem == ""
    roles = {llama.role.get(op.node) for op in _capture("llama").ops if "input_layernorm" in op.module}
    assert roles == {"sequence"}  # the norms between the pairs run on sequence shards
    gpt = tensor_parallel_facts(_capture("gpt"), fused_split=False)  # the fused qkv's attention stays whole
    assert "aten.split" in gpt.sequence_parallel_problem and "attn" in gpt.sequence_parallel_problem
    assert tensor_parallel_facts(_capture("gpt")).sequence_parallel_problem == ""  # Megatron-LM's split qkv


def test_sp_pin_defaults_on_with_tp_and_is_refused_where_the_model_cannot_run_it():
    from autoplan.solve.pins import parse_pins

    assert parse_pins("tp=2,sp=off").sp == "off" and parse_pins("tp=2").sp is None
    with pytest.raises(UserError, match="sp=maybe is not one of on, off"):
        parse_pins("sp=maybe")
    llama, gpt = _capture("llama"), _capture("gpt")
    training = Training(global_batch_size=8)
    assert search(llama, cluster(2), training, Layout(tp=2)).best.parallelism.sp
    assert not search(llama, cluster(2), training, Layout(tp=2, sp="off")).best.parallelism.sp
    assert not search(gpt, cluster(2), training, Layout(tp=2)).best.parallelism.sp
    with pytest.raises(UserError, match="sp=on with tp=2: aten.split.Tensor in blocks.*does not compute token by token"):
        search(gpt, cluster(2), training, Layout(tp=2, sp="on"))
    dense = search(llama, cluster(2), training, Layout(tp=1)).best.parallelism
    assert not dense.sp  # nothing to shard on the sequence without tensor parallelism
