"""Folded expert parallelism (issue 28) on HF OLMoE and HF DeepSeek-V3, tiny configs built from transformers'
classes: `autoplan verify`'s loss and every-gradient parity against the single-device model on CPU/gloo, in one
4-process launch (tests/helpers/verify_many.py), for each model:

- ep over the tp ranks (dp=1 x tp=2 x ep=2; OLMoE with sequence parallelism), dp x ep x tp (dp=2 x tp=2 x ep=4,
  FSDP2; OLMoE with sequence parallelism), pp x ep x tp (pp=2 x tp=2 x ep=2) and cp x ep (cp=2 x ep=2), the degrees
  pinned;
- the search's own plans on 4 ranks: with nothing pinned, and with ep=2 pinned (the search picks the rest).

OLMoE's q/k norms are RMS norms over every head's features at once (OLMo-2's too): under tp each rank holds its
heads' features, sums their squares and one all-reduce of that sum per token joins the ranks (DTensor's Partial
mean; chain/tensor_parallel.py SUMMED_OPS), so its attention is split by heads and sequence parallelism runs through
it and through the MoE blocks (before, the attention stayed whole on every tp rank and sp was refused).

DeepSeek-V3 (tests/models/tiny_deepseek_v3.py): multi-head latent attention, a dense first layer
(first_k_dense_replace=1), then MoE layers with a grouped sigmoid router and a shared expert (a colwise/rowwise
Linear pair under tp). Its router multiplies by `self.weight.type(torch.float32)`: a cast of the parameter, not an
activation, so cp is allowed (before, the capture took that matmul for activation x activation attention, which the
ring cannot replace, and refused cp). Its values are narrower than its queries and keys (v_head_dim 4, q/k 8), which
sends CPU SDPA to its math path; the CPU ring pads them (runtime/distributed/context_parallel.py _value_width_as_query).
Its attention is split by heads as torchtitan splits it (q_b_proj and kv_b_proj colwise, o_proj rowwise, the q and
kv latents q_a_proj / kv_a_proj_with_mqa whole): the keys are built with new_empty and two copy_ into its slices,
the shared rotary key (one head, from the whole kv_a_proj_with_mqa) expanded into every split head. With sequence
parallelism the latents run on sequence shards; the rotary key stays a DTensor sharded on its sequence dimension
([b, 1, s, d]: views, rotation by the position table, a cat and the expand keep that dimension whole) and is
gathered where the split keys read it; the MoE blocks run on each rank's tokens (their group-limited router gathers
and scatters within each token's row), their shared experts' Linear pair on DTensors inside them. Before, the
attention stayed whole and sequence parallelism was refused at the queries' transpose.

Sequence parallelism with a pipeline (pp x ep x tp, sp=on): the stages call the MoE blocks as the model's own
modules (runtime/distributed/expert_calls.py modules_as_calls), which run on each rank's tokens; before, sp was refused with
pp > 1 (a stage's exported graph inlined them).
"""

import json
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, ProfileOptions, plan_model, profile_only
from autoplan.chain.attention import attention_facts
from autoplan.chain.tensor_parallel import tensor_parallel_facts

from helpers.verify_many import verify_many
from test_expert_parallel_program import SOURCES
from test_layouts import check_parity

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK_V3 = ROOT / "tests" / "models" / "tiny_deepseek_v3.py"
MODELS = {"olmoe": SOURCES["olmoe"], "deepseek_v3": DEEPSEEK_V3.read_text()}
CASES = {f"{model} {pin or 'search'}": (model, pin, gpus) for model, pins in (
    ("olmoe", ("dp=1,tp=2,ep=2,sp=on", "dp=2,zero=3,tp=2,ep=4,sp=on")),
    ("deepseek_v3", ("dp=1,tp=2,ep=2,sp=on", "dp=2,zero=3,tp=2,ep=4,sp=on"))) for pin, gpus in zip(pins, (2, 4))}
CASES.update({f"{model} {pin or 'search'}": (model, pin, gpus) for model in MODELS for pin, gpus in (
    ("pp=2,tp=2,ep=2,sp=on", 4), ("dp=1,cp=2,ep=2", 2), ("ep=2", 4), ("", 4))})


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
        plan_model(str(sources[model]), gpus, "cpu", PlanOptions(global_batch=8, pin=pin or None, out=folders[name]))
    result = verify_many(list(folders.values()), steps=2, timeout_s=2400, nproc=4)
    return dict(zip(folders, result.results)), folders


@pytest.mark.slow  # one 4-process torchrun launch
@pytest.mark.parametrize("name", list(CASES))
def test_folded_expert_parallel_trains_like_the_single_device_model(batch, name):
    results, folders = batch
    check_parity(results[name])  # the losses and every gradient of the first steps, on every rank
    plan = json.loads((folders[name] / "plan.json").read_text())
    parallelism, pin = plan["parallelism"], CASES[name][1]
    print(name, {k: v for k, v in parallelism.items() if "degree" in k or k == "enable_sequence_parallel"})
    pins = {key: value for key, value in (item.split("=") for item in pin.split(",") if item)}
    for key, field in (("ep", "expert_parallel_degree"), ("tp", "tensor_parallel_degree"),
                       ("pp", "pipeline_parallel_degree"), ("cp", "context_parallel_degree")):
        if key in pins:
            assert parallelism[field] == int(pins[key])
    if pins.get("sp") == "on":  # the MoE blocks run on each tp rank's sequence shard
        assert parallelism["enable_sequence_parallel"]
        moe = (1, 2) if CASES[name][0] == "deepseek_v3" else (0, 1)  # DeepSeek-V3's first layer is dense
        assert {f"model.layers.{i}.mlp" for i in moe} <= {
            m for m, style in plan["tensor_parallel_plan"].items() if style == "sequence_local"}


def test_deepseek_v3_router_multiplies_by_its_weight_so_context_parallel_is_allowed(sources):
    """The router's `F.linear(x.float(), self.weight.float())`: the matmul reads the parameter through a cast, which
    the capture records as a separate node; it is a matmul by a weight (priced as a GEMM), not attention."""
    profile = profile_only(str(sources["deepseek_v3"]), "h100-sxm5-80gb", ProfileOptions(measure=False))
    router = [op for op in profile.ops if op.module == "model.layers.1.mlp.gate" and op.op == "aten.linear.default"]
    assert len(router) == 1 and router[0].params == ("model.layers.1.mlp.gate.weight",)
    assert attention_facts(profile).context_parallel_problem == ""


def test_olmoe_attention_is_split_by_heads_with_its_norms_summed_over_the_ranks(sources):
    facts = tensor_parallel_facts(profile_only(str(sources["olmoe"]), "h100-sxm5-80gb", ProfileOptions(measure=False)))
    for layer in (0, 1):
        attention = f"model.layers.{layer}.self_attn"
        assert {facts.plan[f"{attention}.{p}_proj"] for p in "qkv"} == {"colwise"}
        assert facts.plan[f"{attention}.o_proj"] == "rowwise"
        assert facts.plan[f"{attention}.q_norm"] == facts.plan[f"{attention}.k_norm"] == "replicate"
        assert facts.plan[f"model.layers.{layer}.mlp"] == "sequence_local"
    assert facts.sequence_parallel_problem == ""
    profile_ops = {op.node: op for op in profile_only(str(sources["olmoe"]), "h100-sxm5-80gb",
                                                      ProfileOptions(measure=False)).ops}
    summed = [profile_ops[n] for n in facts.rank_sums]
    assert len(summed) == 4 and all(op.op == "aten.mean.dim" and op.module.endswith("_norm") for op in summed)


def test_deepseek_v3_attention_is_split_by_heads_and_sequence_parallelism_runs_through_it(sources):
    profile = profile_only(str(sources["deepseek_v3"]), "h100-sxm5-80gb", ProfileOptions(measure=False))
    facts = tensor_parallel_facts(profile)
    assert facts.sequence_parallel_problem == ""
    for layer in (0, 1, 2):
        attention = f"model.layers.{layer}.self_attn"
        assert facts.plan[f"{attention}.q_b_proj"] == facts.plan[f"{attention}.kv_b_proj"] == "colwise"
        assert facts.plan[f"{attention}.o_proj"] == "rowwise"
        assert f"{attention}.q_a_proj" not in facts.plan and f"{attention}.kv_a_proj_with_mqa" not in facts.plan
    for layer in (1, 2):  # the MoE blocks run on local tokens; their shared experts stay a tensor-parallel pair
        assert facts.plan[f"model.layers.{layer}.mlp"] == "sequence_local"
        assert facts.plan[f"model.layers.{layer}.mlp.shared_experts.down_proj"] == "rowwise"
    assert facts.plan["model.layers.0.mlp.down_proj"] == "rowwise"  # the dense first layer
    ops = {op.node: op for op in profile.ops}
    rotary = [n for n, r in facts.role.items() if r == "sequence" and ops[n].op == "aten.expand.default"]
    assert len(rotary) == 3  # each layer's shared rotary key, expanded over the heads on its sequence shard


def test_the_search_plans_a_pipeline_with_sp_through_moe_blocks(sources, tmp_path):
    """OLMoE allows sp (on by default with tp > 1), with pp > 1 too: the stages call its MoE blocks as modules, run
    on each rank's tokens (before, sp was refused with a pipeline: a stage's graph inlined them)."""
    plan_model(str(sources["olmoe"]), 4, "cpu", PlanOptions(global_batch=8, pin="pp=2,tp=2,ep=2", out=tmp_path / "out"))
    parallelism = json.loads((tmp_path / "out" / "plan.json").read_text())["parallelism"]
    assert parallelism["pipeline_parallel_degree"] == parallelism["tensor_parallel_degree"] == 2
    assert parallelism["enable_sequence_parallel"]


def test_deepseek_v3_rotary_key_gathered_into_the_split_keys_is_priced_under_sp(sources):
    """The shared rotary key reaches the split keys' copy_ as a sequence shard: with sp its expanded bytes are
    all-gathered in forward and reduce-scattered in backward (cost/compute.py), and nothing without sp."""
    from autoplan.api import load_cluster
    from autoplan.cost import comm
    from dataclasses import replace

    from autoplan.cost.compute import TableSetting, _tp_backward, _tp_forward
    from autoplan.cost.context import Context
    from autoplan.cost.module_costs import _op_costs
    from autoplan.layout import SUPPORTED
    from autoplan.plan import Training

    profile = profile_only(str(sources["deepseek_v3"]), "h100-sxm5-80gb", ProfileOptions(measure=False))
    facts = tensor_parallel_facts(profile)
    by_node = {op.node: op for op in profile.ops}
    copies = [(node, cost) for node, cost in zip(by_node, _op_costs(list(by_node), by_node, profile, facts))
              if cost.gathered_shard_bytes]
    assert [by_node[n].op for n, _ in copies] == ["aten.copy_.default"] * 3  # one per layer
    cluster = load_cluster(4, "h100-sxm5-80gb", 8, None, None)
    link = Context(profile, cluster, Training(global_batch_size=8), SUPPORTED).group(2, 1).link
    setting = TableSetting(gpu=cluster.gpu, capture_dtype="fp32", train_dtype="fp32", tp=2, microbatch=4, tp_link=link,
                           use_measured=False, sp=True)
    for node, cost in copies:
        expand = next(by_node[s] for s in by_node[node].inputs if by_node[s].op == "aten.expand.default")
        assert cost.gathered_shard_bytes == expand.output_bytes / profile.batch_size
        assert _tp_forward(cost, setting, 1.0) == comm.all_gather_s(cost.gathered_shard_bytes * 4, 2, link)
        assert _tp_backward(cost, 2, 4.0, link, sp=True) == comm.reduce_scatter_s(cost.gathered_shard_bytes * 4, 2,
                                                                                 link)
        assert _tp_forward(cost, replace(setting, sp=False), 1.0) == _tp_backward(cost, 2, 4.0, link, sp=False) == 0.0

