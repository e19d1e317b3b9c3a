"""Planning context parallelism (cp) and expert parallelism (ep): the rules with their arithmetic, the pins, plan.json,
and the pricing checked against closed forms written out here (issue 19)."""

from __future__ import annotations

import pytest
from chain_fixtures import cluster, gpt_profile

from autoplan.chain.attention import attention_facts
from autoplan.cost.compute import ModuleTable, ShardedModules, sharded_table
from autoplan.cost.context import Context
from autoplan.cost.evaluate import build_problem, with_memory_without_cp_ep
from autoplan.cost.memory import MemoryInputs, layout_memory
from autoplan.errors import UserError
from autoplan.layout import ALL_FEATURES, SUPPORTED, Layout, Scope, problems
from autoplan.plan import Parallelism, _build
from autoplan.solve.pins import parse_pins
from autoplan.plan import Training
from autoplan.solve.search import search, try_layout

CP_EP = SUPPORTED | {"cp", "ep"}


def test_the_rules_give_their_arithmetic():
    scope = Scope(num_gpus=8, gpus_per_node=8, sequence_length=2048, context_parallel_problem="", num_experts=(8, 8),
                  features=ALL_FEATURES)
    text = "; ".join(problems(Layout(cp=3, ep=3, dp=8), scope))
    for part in ("cp=3: 2 x cp = 6 load-balanced chunks does not divide the sequence of 2048 tokens (2048 % 6 = 2)",
                 "cp=3 does not divide 8 GPUs", "ep=3 does not divide the 8 experts of an expert layer (8 % 3 = 2)"):
        assert part in text, text
    assert problems(Layout(ep=4, dp=2), scope) == [
        "ep=4 does not divide dp=2 x cp=1 = 2 (expert parallelism borrows its ranks from the data- and "
        "context-parallel ones)"]
    assert problems(Layout(dp=2, cp=2, tp=2, pp=1), Scope(num_gpus=16)) == ["dp=2 x cp=2 x tp=2 x pp=1 = 8, not 16 GPUs"]
    assert problems(Layout(dp=2, cp=2, tp=2, pp=2, ep=4), Scope(num_gpus=16)) == []  # ep borrows: it does not multiply
    no_experts = problems(Layout(ep=2), Scope(num_experts=()))
    assert no_experts == ["ep=2, but the model has no expert layers (a router's top-k over stacked expert weights) to "
                          "shard (use ep=1)"]
    why = "its attention is computed by aten.bmm.default in 'h.0.attn' (activation x activation matmuls), not ..."
    assert problems(Layout(cp=2), Scope(context_parallel_problem=why)) == [f"cp=2: {why} (use cp=1)"]
    assert problems(Layout(cp=2, zero=0), Scope()) == [
        "zero=0 (DDP) with cp=2: context parallelism shards the model states over dp_shard x cp (FSDP, as torchtitan; "
        "use zero=1, 2 or 3)"]


def test_cp_pins_plan_and_cp_with_pp_or_tp_and_ep_are_refused_while_the_program_cannot_run_them():
    assert parse_pins("cp=2,ep=2") == Layout(cp=2, ep=2)
    profile = gpt_profile(n_layer=4, seq=2048, batch=2)
    training = Training(global_batch_size=8, dtype="bf16")
    pinned = search(profile, cluster(8), training, parse_pins("cp=2")).best
    par = pinned.parallelism
    assert par.context_parallel_degree == 2 and par.sharded and par.world_size == 8
    assert par.pipeline_parallel_degree == par.tensor_parallel_degree == 1
    with pytest.raises(UserError, match=r"cp=2 with pp=2: the program cannot yet run context parallelism inside "
                                        r"pipeline stages \(use cp=1 or pp=1\)"):
        search(profile, cluster(8), training, parse_pins("cp=2,pp=2"))
    with pytest.raises(UserError, match=r"cp=2 with tp=2: the program cannot yet run context parallelism together "
                                        r"with tensor parallelism \(use cp=1 or tp=1\)"):
        search(profile, cluster(8), training, parse_pins("cp=2,tp=2"))
    with pytest.raises(UserError, match=r"expert parallelism is priced but the generated program cannot run it yet "
                                        r"\(ep=2; use ep=1\)"):
        search(profile, cluster(8), training, parse_pins("ep=2"), features=SUPPORTED - {"ep"})
    with pytest.raises(UserError, match="the model has no expert layers"):
        search(profile, cluster(8), training, parse_pins("ep=2"))
    default = search(profile, cluster(8), training, features=CP_EP)  # no experts: ep is never tried
    assert all(c.parallelism.expert_parallel_degree == 1 for c in default.candidates)


def test_the_program_runs_ep_over_fsdp_ranks_also_in_pipeline_stages_and_the_rules_say_why_not_otherwise():
    scope = Scope(features=SUPPORTED)
    assert problems(Layout(dp_replicate=1, dp_shard=4, ep=2, pp=1, tp=1, cp=1), scope) == []
    assert problems(Layout(dp_replicate=2, dp_shard=2, ep=2), scope) == []  # HSDP: ep splits each shard group
    assert problems(Layout(dp_shard=2, ep=2, pp=2, tp=2, cp=2), scope) == [
        "cp=2 with pp=2: the program cannot yet run context parallelism inside pipeline stages (use cp=1 or pp=1)",
        "cp=2 with tp=2: the program cannot yet run context parallelism together with tensor parallelism "
        "(use cp=1 or tp=1)",
        "ep=2 with tp=2: the program cannot yet run expert parallelism together with tensor parallelism (the "
        "experts' stacked weights are not split within an expert; use ep=1 or tp=1)",
        "ep=2 with cp=2: the program splits the experts over data-parallel ranks only, not over the "
        "context-parallel ones that hold the same samples (use ep=1 or cp=1)"]
    assert problems(Layout(dp_replicate=4, dp_shard=1, ep=2), scope) == [
        "ep=2 does not divide dp_shard=1 (1 % 2 = 1): the program splits the experts over ranks that FSDP2 shards "
        "the other parameters over, not beside DDP (use zero=3 with ep dividing dp, or ep=1)"]
    assert problems(Layout(dp=4, zero=0, ep=2), scope) == [
        "ep=2 with zero=0 (DDP): the program splits the experts over ranks that FSDP2 shards the other parameters "
        "over, not beside DDP (use zero=3 or ep=1)"]
    assert problems(Layout(dp_shard=2, ep=2, pp=2, tp=2, cp=2), Scope(features=ALL_FEATURES)) == []  # priced
    assert problems(Layout(dp_shard=2, ep=2, pp=2), scope) == []  # the stages call the experts modules
    assert problems(Layout(dp_shard=2, ep=2, pp=2), Scope(features=SUPPORTED - {"ep_pp"})) == [
        "ep=2 with pp=2: expert parallelism inside pipeline stages is not supported here (use ep=1 or pp=1)"]


def test_a_parallel_config_with_ep_the_program_cannot_run_is_refused_before_any_process_group():
    from autoplan.runtime.apply_plan import _check_runnable
    from autoplan.runtime.config import ParallelConfig

    with pytest.raises(UserError, match=r"ep=2 with tp=2: the program cannot yet run expert parallelism"):
        _check_runnable(ParallelConfig(dp_shard=2, ep=2, tp=2))
    _check_runnable(ParallelConfig(dp_shard=2, ep=2, pp=2, stages=(("a",), ("b",))))
    with pytest.raises(UserError, match=r"ep=2 does not divide dp_shard=1 \(1 % 2 = 1\)"):
        _check_runnable(ParallelConfig(dp_replicate=2, ep=2))
    _check_runnable(ParallelConfig(dp_shard=2, ep=2))
    with pytest.raises(UserError, match=r"degrees must be positive integers, got ep 0"):
        ParallelConfig(ep=0)


def test_the_default_search_keeps_cp_out_of_pipelines_and_tensor_parallelism():
    scope = Scope(features=SUPPORTED)
    assert problems(Layout(cp=2, pp=2, tp=2), scope) == [
        "cp=2 with pp=2: the program cannot yet run context parallelism inside pipeline stages (use cp=1 or pp=1)",
        "cp=2 with tp=2: the program cannot yet run context parallelism together with tensor parallelism "
        "(use cp=1 or tp=1)"]
    assert problems(Layout(cp=2, pp=2, tp=2), Scope(features=ALL_FEATURES)) == []  # priced all the same
    assert problems(Layout(cp=2, pp=1, tp=1), scope) == []
    long = gpt_profile(n_layer=4, seq=8192, batch=1)
    result = search(long, cluster(8), Training(global_batch_size=8, dtype="bf16"))
    with_cp = [c.parallelism for c in result.candidates if c.parallelism.context_parallel_degree > 1]
    assert with_cp, "the default search tries cp on long sequences"
    assert all(p.pipeline_parallel_degree == 1 and p.tensor_parallel_degree == 1 for p in with_cp)


def test_attention_written_as_matmuls_refuses_cp_with_the_reason():
    profile = gpt_profile(n_layer=2, seq=2048, attention="megatron")
    assert "not scaled_dot_product_attention" in attention_facts(profile).context_parallel_problem
    with pytest.raises(UserError, match="cp=2: its attention is computed by"):
        search(profile, cluster(8), Training(global_batch_size=8), parse_pins("cp=2"), features=CP_EP)
    sdpa = attention_facts(gpt_profile(n_layer=2, seq=2048))
    assert sdpa.context_parallel_problem == "" and sdpa.sequence_length == 2048


def test_plan_json_without_the_new_keys_loads_and_cp_multiplies_the_world_size():
    old = _build(Parallelism, {"parallelism": {"tensor_parallel_degree": 2}}, "parallelism")
    assert (old.context_parallel_degree, old.expert_parallel_degree) == (1, 1)
    par = Parallelism(data_parallel_shard_degree=2, context_parallel_degree=4, tensor_parallel_degree=2,
                      expert_parallel_degree=8)
    assert par.world_size == 2 * 4 * 2  # ep borrows from dp x cp
    assert par.fsdp_shard_degree == 8 and par.sharded
    assert Parallelism(context_parallel_degree=2).sharded  # FSDP over the cp ranks, as torchtitan


def test_sharded_table_divides_by_cp_and_waits_for_the_busiest_expert_rank():
    base = ModuleTable(forward_s=(1.0, 2.0), backward_s=(2.0, 4.0), tp_forward_s=(0.2, 0.0), tp_backward_s=(0.4, 0.0),
                       cheap_forward_s=(0.1, 0.3), activation_bytes={"none": (100.0, 80.0), "selective": (40.0, 50.0),
                                                                      "full": (10.0, 10.0)},
                       working_bytes=(100.0, 200.0))
    sharded = ShardedModules(cp=4, expert_forward_s=(0.0, 1.0), expert_backward_s=(0.0, 2.0), imbalance=(1.0, 1.5),
                             ring_forward_s=(0.01, 0.0), ring_backward_s=(0.03, 0.0), all_to_all_s=(0.0, 0.08),
                             saved_change_bytes=(-20.0, 0.0), input_change_bytes=(0.0, -4.0))
    table = sharded_table(base, sharded)
    assert table.forward_s == pytest.approx((1.0 / 4, (2.0 + 0.5 * 1.0) / 4))
    assert table.backward_s == pytest.approx((2.0 / 4, (4.0 + 0.5 * 2.0) / 4))
    assert table.tp_forward_s == pytest.approx((0.05, 0.0)) and table.cheap_forward_s == pytest.approx((0.025, 0.075))
    assert table.activation_bytes["none"] == pytest.approx((80 / 4, 80 / 4))
    assert table.activation_bytes["selective"] == pytest.approx((40 / 4, 46 / 4))
    assert table.activation_bytes["full"] == pytest.approx((10 / 4, 6 / 4))
    assert table.working_bytes == pytest.approx((80 / 4, 200 / 4))
    assert table.ep_forward_s == pytest.approx((0.0, 0.04)) and table.ep_backward_s == pytest.approx((0.0, 0.04))
    # none: forward + backward + collectives + ring + all-to-alls; full adds the forward's part of each again
    assert table.time_s("none")[0] == pytest.approx(0.25 + 0.5 + 0.05 + 0.1 + 0.01 + 0.03)
    assert table.time_s("full")[1] == pytest.approx(2.5 / 4 + 5.0 / 4 + 0.08 + 2.5 / 4 + 0.04)


@pytest.mark.parametrize("shard, reshard, expert_shard", [(8, True, 2), (8, False, 1), (1, False, 1)])
def test_expert_states_shard_over_the_fsdp_group_left_after_ep(shard, reshard, expert_shard):
    """(n - e) x 16 / shard + e x 16 / expert_shard bytes with bf16 AdamW (2 + 2 + 12; sharded as zero 3)."""
    n, e = 1000.0, 600.0  # module elements on the rank, of which expert elements (already E/ep)
    inputs = MemoryInputs(module_numel=(n,), group_numel=(), tied_group_modules=(), module_largest_numel=(n,),
                          activations={"none": (0.0,)}, working_bytes=(0.0,), cut_bytes=(), expert_numel=(e,))
    memory = layout_memory(inputs, "bf16", shard, reshard, 1, expert_shard=expert_shard)
    states = {c: memory.per_module[c][0] for c in ("parameters", "gradients", "optimizer")}
    if shard == 1:
        assert states == pytest.approx({"parameters": 2 * n, "gradients": 2 * n, "optimizer": 12 * n})
    elif reshard:
        assert sum(states.values()) == pytest.approx((n - e) * 16 / shard + e * 16 / expert_shard)
    else:  # FSDP2 without resharding: parameters whole, gradients and optimizer sharded
        assert states["parameters"] == pytest.approx(2 * n)
        assert states["gradients"] + states["optimizer"] == pytest.approx((n - e) * 14 / shard + e * 14 / expert_shard)


def test_context_parallel_halves_activations_and_prices_the_exposed_ring():
    """On a slow link (1 MB/s) the ring hides nothing: per attention layer and micro-batch at cp = 2 the forward
    exposes one K/V block send and the backward one K/V send, one gradient send hidden behind nothing and the
    last gradient block coming home: 2 x (alpha + B / bw) + 2 x (alpha + 2B / bw), B = 2 x b x seq/cp x h x 2 bytes
    (K and V, bf16) and the gradient block in fp32 (2B)."""
    layers, seq, hidden, batch = 2, 1024, 64, 4
    bandwidth, latency = 1e6, 1e-5
    profile = gpt_profile(n_layer=layers, n_embd=hidden, seq=seq, batch=2)
    ctx = Context(profile, cluster(4, intra_bw=bandwidth, latency_s=latency), Training(batch, "bf16"), CP_EP)
    one, two = ctx.table(1, 1), ctx.table(1, 1, cp=2)
    assert two.activation_bytes["full"] == pytest.approx(tuple(a / 2 for a in one.activation_bytes["full"]))
    assert sum(two.forward_s) == pytest.approx(sum(one.forward_s) / 2)
    block = 2 * 1 * seq / 2 * hidden * 2
    per_layer = 2 * (latency + block / bandwidth) + 2 * (latency + 2 * block / bandwidth)
    assert sum(two.cp_forward_s) + sum(two.cp_backward_s) == pytest.approx(layers * per_layer, rel=1e-3)
    par = Parallelism(data_parallel_shard_degree=2, fsdp_reshard_after_forward="always", context_parallel_degree=2,
                      pipeline_parallel_num_microbatches=2)
    problem = build_problem(ctx, par, ("none",))
    assert problem.memory_cap_bytes > 0
    priced = try_layout(ctx, par, ("none",))
    assert priced.predicted.time_breakdown["context_parallel_comm"] == pytest.approx(2 * layers * per_layer, rel=1e-3)
    whole = with_memory_without_cp_ep(ctx, priced, ("none",)).predicted.peak_memory_without_context_parallel_bytes
    assert whole is not None and whole > priced.predicted.peak_memory_bytes


def test_the_report_names_cp_and_ep_and_shows_memory_with_them_set_back_to_1():
    from dataclasses import replace

    from report_fixtures import make_plan

    from autoplan.report.html import memory_section
    from autoplan.report.rollup import describe_layout

    plan = make_plan(pp=1, dp=2, microbatches=16)
    plan = replace(plan, cluster=replace(plan.cluster, num_gpus=8), parallelism=replace(plan.parallelism, context_parallel_degree=4, expert_parallel_degree=2),
                   predicted=replace(plan.predicted, peak_memory_without_context_parallel_bytes=50 * 2**30,
                                     peak_memory_without_expert_parallel_bytes=30 * 2**30))
    name = describe_layout(plan.parallelism)
    assert "CP 4" in name and "EP 2" in name
    html = memory_section(plan)
    assert "Context parallelism" in html and "cp=1 would need 50 GiB" in html
    assert "Expert parallelism" in html and "ep=1 would need 30 GiB" in html
    restored = type(plan).from_json(plan.to_json())  # plan.json round trip with the new fields
    assert restored.parallelism.context_parallel_degree == 4
    assert restored.predicted.peak_memory_without_expert_parallel_bytes == 30 * 2**30
