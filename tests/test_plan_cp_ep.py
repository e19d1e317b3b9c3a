"""Planning context parallelism (cp) and expert parallelism (ep): the rules with their arithmetic, the pins, plan.json,
and the pricing checked against closed forms written out here (issue 19)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from chain_fixtures import cluster, gpt_profile

from autoplan.cost.context import TableKey
from autoplan.chain.attention import attention_facts
from autoplan.cost.compute import ModuleTable, ShardedModules, sharded_table
from autoplan.cost.context import Context, expert_shard_degree
from autoplan.cost.evaluate import build_problem, with_memory_without_cp_ep
from autoplan.cost.memory import MemoryInputs, MemoryLayout, layout_memory
from autoplan.errors import UserError
from autoplan.layout import ALL_FEATURES, SUPPORTED, ZERO_BUBBLE_SCHEDULES, Layout, Scope, from_plan_fields, problems
from autoplan.plan import Parallelism
from autoplan.solve.layouts import families
from autoplan.solve.pins import parse_pins
from autoplan.plan import Training
from autoplan.solve.search import SearchOptions, search, try_layout

CP_EP = SUPPORTED | {"cp", "ep"}


def test_the_rules_give_their_arithmetic():
    scope = Scope(num_gpus=8, gpus_per_node=8, sequence_length=2048, context_parallel_problem="", num_experts=(8, 8),
                  features=ALL_FEATURES)
    text = "; ".join(problems(Layout(cp=3, ep=3, dp=8), scope))
    for part in ("cp=3: the sequence of 2048 tokens does not split into 2 x cp = 6 load-balanced chunks (2048 % 6 = 2)",
                 "cp=3 does not divide 8 GPUs", "ep=3 does not divide the 8 experts of an expert layer (8 % 3 = 2)"):
        assert part in text, text
    assert problems(Layout(ep=4, dp=2), scope) == [
        "ep=4 does not divide dp=2 x cp=1 x tp=1 = 2 (2 % 4 = 2; expert parallelism is cut from the data-, context- "
        "and tensor-parallel ranks of a pipeline rank)"]
    assert problems(Layout(ep=4, dp=2, tp=2), scope) == problems(Layout(ep=4, dp=1, cp=2, tp=2), scope) == []
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


def test_cp_pins_plan_with_a_pipeline_and_with_tp():
    assert parse_pins("cp=2,ep=2") == Layout(cp=2, ep=2)
    profile = gpt_profile(n_layer=4, seq=2048, batch=2)
    training = Training(global_batch_size=8, dtype="bf16")
    pinned = search(profile, cluster(8), training, parse_pins("cp=2")).best
    par = pinned.parallelism
    assert par.cp == 2 and par.fsdp_enabled and par.world_size == 8
    assert par.pp == par.tp == 1
    staged = search(profile, cluster(8), training, parse_pins("cp=2,pp=2")).best.parallelism
    assert (staged.cp, staged.pp, staged.world_size) == (2, 2, 8)
    assert staged.fsdp_enabled  # FSDP2 over dp_shard x cp inside each stage
    with_tp = search(profile, cluster(8), training, parse_pins("cp=2,tp=2")).best.parallelism  # runs since cp_tp
    assert (with_tp.cp, with_tp.tp, with_tp.world_size) == (2, 2, 8)
    three = search(profile, cluster(8), training, parse_pins("cp=2,pp=2,tp=2")).best.parallelism  # all three run
    assert (three.cp, three.pp, three.tp) == (2, 2, 2)
    with pytest.raises(UserError, match=r"expert parallelism is priced but the generated program cannot run it yet "
                                        r"\(ep=2; use ep=1\)"):
        search(profile, cluster(8), training, parse_pins("ep=2"), options=SearchOptions(features=SUPPORTED - {"ep"}))
    with pytest.raises(UserError, match="the model has no expert layers"):
        search(profile, cluster(8), training, parse_pins("ep=2"))
    default = search(profile, cluster(8), training,
                     options=SearchOptions(features=CP_EP))  # no experts: ep is never tried
    assert all(c.parallelism.ep == 1 for c in default.candidates)


def test_the_program_runs_ep_folded_over_dp_shard_cp_tp_or_in_pipeline_stages_and_the_rules_say_why_not_otherwise():
    scope = Scope(features=SUPPORTED)
    assert problems(Layout(dp_replicate=1, dp_shard=4, ep=2, pp=1, tp=1, cp=1), scope) == []
    assert problems(Layout(dp_replicate=2, dp_shard=2, ep=2), scope) == []  # HSDP: ep splits each shard group
    assert problems(Layout(dp_shard=2, ep=2, pp=2, tp=2, cp=2), scope) == []  # folded over dp_shard x cp x tp
    assert problems(Layout(dp_shard=2, ep=2, cp=2), Scope(features=SUPPORTED - {"ep_cp"})) == [
        "ep=2 with cp=2: the program does not yet fold expert parallelism over the context-parallel ranks (use ep=1 "
        "or cp=1)"]
    assert problems(Layout(dp_shard=2, ep=2, tp=2, sp="on"), scope) == []  # experts whole on every tp rank
    assert problems(Layout(dp_replicate=2, dp_shard=1, ep=4, tp=4), scope) == []  # ep over the tp ranks
    assert problems(Layout(dp_shard=2, ep=2, tp=2), Scope(features=SUPPORTED - {"ep_tp"})) == [
        "ep=2 with tp=2: the program cannot yet run expert parallelism together with tensor parallelism (use ep=1 "
        "or tp=1)"]
    assert problems(Layout(dp_replicate=4, dp_shard=1, ep=2), scope) == [
        "ep=2 does not divide dp_shard=1 x cp=1 x tp=1 = 1 (1 % 2 = 1): the program cuts expert parallelism from the "
        "ranks of one data-parallel replica, not across replicas (use a larger dp_shard, or an ep dividing 1)"]
    assert problems(Layout(dp=4, zero=0, ep=2), scope) == [
        "ep=2 with zero=0 (DDP): the program shards the experts' states with FSDP2 over the ranks holding the same "
        "experts, not beside DDP (use zero=3 or ep=1)"]
    assert problems(Layout(dp_shard=2, ep=2, pp=2, tp=2, cp=2), Scope(features=ALL_FEATURES)) == []  # priced
    assert problems(Layout(dp_shard=2, ep=2, pp=2), scope) == []  # the stages call the experts modules
    assert problems(Layout(dp_shard=2, ep=2, pp=2), Scope(features=SUPPORTED - {"ep_pp"})) == [
        "ep=2 with pp=2: expert parallelism inside pipeline stages is not supported here (use ep=1 or pp=1)"]


def test_a_parallel_config_with_ep_the_program_cannot_run_is_refused_before_any_process_group():
    from autoplan.runtime.apply_plan import _check_runnable
    from autoplan.runtime.distributed.config import ParallelConfig

    _check_runnable(Parallelism(dp_shard=2, ep=2, tp=2, pp=2))  # all three run
    _check_runnable(Parallelism(dp_shard=2, ep=2, cp=2))
    _check_runnable(Parallelism(ep=2, tp=2))  # ep over the tp ranks
    _check_runnable(Parallelism(dp_shard=2, ep=2, tp=2))
    _check_runnable(Parallelism(dp_shard=2, ep=2, pp=2))
    with pytest.raises(UserError, match=r"ep=2 does not divide dp_shard=1 x cp=1 x tp=1 = 1 \(1 % 2 = 1\)"):
        _check_runnable(Parallelism(dp_replicate=2, ep=2))
    _check_runnable(Parallelism(dp_shard=2, ep=2))
    with pytest.raises(UserError, match=r"parallel config: ep must be a positive integer, got 0"):
        ParallelConfig(Parallelism(ep=0))


def test_the_search_tries_zero_bubble_schedules_with_a_ring_and_without():
    """The zero-bubble schedules run with context parallelism (each stage's FSDP2 gradients over the ring are reduced
    after its last weight-gradient pass, runtime/distributed/split_backward.py; tests/test_zero_bubble_program.py trains them at
    parity): the search lists them beside cp=2 and beside cp=1 (before, a rule refused them with cp > 1)."""
    profile = gpt_profile(n_layer=4, seq=2048, batch=2)
    result = search(profile, cluster(4), Training(global_batch_size=8, dtype="bf16"), parse_pins("cp=2,pp=2"))
    rings = [c.parallelism for c in result.candidates if c.parallelism.cp > 1]
    assert rings and result.best.parallelism.cp == 2
    assert {p.schedule for p in rings} & set(ZERO_BUBBLE_SCHEDULES)
    unringed = search(profile, cluster(2), Training(global_batch_size=8, dtype="bf16"), parse_pins("cp=1,pp=2"))
    assert {c.parallelism.schedule for c in unringed.candidates} & set(ZERO_BUBBLE_SCHEDULES), \
        "without a ring the zero-bubble schedules are tried"


def test_the_default_search_tries_cp_inside_pipelines_and_with_tensor_parallelism():
    scope = Scope(features=SUPPORTED)
    assert problems(Layout(cp=2, pp=2, tp=1), scope) == []
    assert problems(Layout(cp=2, pp=2, tp=2), scope) == []
    assert problems(Layout(cp=2, pp=1, tp=2), scope) == []
    assert problems(Layout(cp=2, pp=2, tp=2), Scope(features=ALL_FEATURES)) == []  # priced all the same
    assert problems(Layout(cp=2, pp=1, tp=1), scope) == []
    # long enough that a ring step's attention outweighs its merges and launches (cost/context_parallel.py)
    long = gpt_profile(n_layer=4, n_embd=2048, n_head=16, seq=32768, batch=1)
    listed = search(long, cluster(8), Training(global_batch_size=8, dtype="bf16"), parse_pins("pp=2")).candidates
    # the fastest (the search's choice may keep DDP within its margin: dp=4 x pp=2 with zb-interleaved, 6% slower)
    staged = min((c for c in listed if c.fits and c.predicted), key=lambda c: c.predicted.step_time_s)
    assert staged.parallelism.cp > 1, "cp inside a pipeline is the fastest on long sequences"
    scope = Scope(num_gpus=8, gpus_per_node=8, global_batch=8, features=SUPPORTED, sequence_length=32768,
                  context_parallel_problem="")
    assert {(f.tp, f.cp) for f in families(Layout(), scope) if f.pp == 1} >= {(2, 2), (2, 4), (4, 2)}  # cp x tp


def test_the_search_tries_a_ring_across_nodes_and_prices_it_on_the_inter_node_link():
    """Two GPUs per node and tp = 2 fill a node: context parallelism can only ring across nodes (torchtitan's tp 8 x
    cp 4 on 8-GPU nodes). Two 32K sequences on 8 GPUs leave dp x cp x pp = 4: the search tries cp beside tp, and
    prices each ring on the inter-node link its cp ranks (stride tp in the mesh) share, dearer than the same
    ring inside one node."""
    long = gpt_profile(n_layer=4, n_embd=2048, n_head=16, seq=32768, batch=1)
    training = Training(global_batch_size=2, dtype="bf16")
    across = cluster(8, gpus_per_node=2)
    result = search(long, across, training, parse_pins("tp=2"))
    rings = [c for c in result.candidates if c.predicted is not None and c.parallelism.cp > 1]
    assert rings and all(c.parallelism.cp in (2, 4) for c in rings)
    assert result.best.parallelism.cp > 1
    for candidate in rings:
        par = candidate.parallelism
        ring = result.context.groups(par).cp
        assert (ring.nodes, ring.link.bus_bandwidth_bytes_per_s) == (par.cp, 20e9)
        inside = search(long, cluster(8, gpus_per_node=8), training, parse_pins(
            f"tp=2,cp={par.cp},pp={par.pp},dp={par.dp}"
            f",microbatch={par.microbatch},recompute={par.recompute}")).best
        priced = candidate.predicted.time_breakdown["context_parallel_comm"]
        assert priced > inside.predicted.time_breakdown["context_parallel_comm"] * 1.5
    scope = Scope(num_gpus=16, gpus_per_node=4, global_batch=16, features=SUPPORTED, sequence_length=32768,
                  context_parallel_problem="")
    tried = {(f.tp, f.cp) for f in families(Layout(), scope)}
    assert {(4, 2), (4, 4), (2, 8), (1, 16)} <= tried  # over whole nodes
    assert (2, 1) in tried and not {(1, 3), (2, 3)} & tried  # cp x tp fills a node evenly or whole nodes


def test_a_small_model_at_8k_tokens_is_not_worth_a_ring():
    """A 4 x 128 GPT at 8K tokens on 8 GPUs, one sequence per GPU: every ring step is a few microseconds of attention
    against its merges, launches and exchange, so data parallelism wins (the ring priced as a free 1/cp of each
    module once made cp = 4 the best layout here)."""
    best = search(gpt_profile(n_layer=4, seq=8192, batch=1), cluster(8), Training(global_batch_size=8, dtype="bf16"))
    assert best.best.parallelism.cp == 1


def test_attention_written_as_matmuls_refuses_cp_with_the_reason():
    profile = gpt_profile(n_layer=2, seq=2048, attention="megatron")
    assert "not scaled_dot_product_attention" in attention_facts(profile).context_parallel_problem
    with pytest.raises(UserError, match="cp=2: its attention is computed by"):
        search(profile, cluster(8), Training(global_batch_size=8), parse_pins("cp=2"),
               options=SearchOptions(features=CP_EP))
    sdpa = attention_facts(gpt_profile(n_layer=2, seq=2048))
    assert sdpa.context_parallel_problem == "" and sdpa.sequence_length == 2048


def test_a_model_without_attention_refuses_cp_in_one_sentence():
    """The refusal read "... for a ring to split the sequence of (use cp=1)" (issue 30): the reason must end in a
    word that ends a clause, before the way out."""
    from autoplan.chain.ops import cost_kind

    profile = gpt_profile(n_layer=2, seq=2048)
    no_attention = replace(profile, ops=tuple(op for op in profile.ops if cost_kind(op) != "attention"))
    why = attention_facts(no_attention).context_parallel_problem
    (text,) = problems(Layout(cp=2), Scope(context_parallel_problem=why))
    assert text.startswith("cp=2: the model calls no scaled_dot_product_attention") and text.endswith(" (use cp=1)")
    assert not re.search(r"\b(of|to|for|with|by|in|on|at|from)$", text.removesuffix(" (use cp=1)")), text


def test_plan_json_without_the_new_keys_loads_and_cp_multiplies_the_world_size():
    old = from_plan_fields({"tensor_parallel_degree": 2})
    assert (old.cp, old.ep) == (1, 1)
    par = Parallelism(dp_shard=2, cp=4, tp=2,
                      ep=8)
    assert par.world_size == 2 * 4 * 2  # ep borrows from dp x cp
    assert par.fsdp_shard == 8 and par.fsdp_enabled
    assert Parallelism(cp=2).fsdp_enabled  # FSDP over the cp ranks, as torchtitan


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
    # with tp and sequence parallelism each tp rank routes its shard: the MoE ops' roles ("sequence_local") price
    # forward_1 and expert_forward_1 on its tokens already (tests/test_moe_sequence_parallel.py), nothing more here


@pytest.mark.parametrize("shard, tp, ep, replicate, expert_shard, expert_replicate", [
    (4, 2, 2, 1, 4, 1),  # ep over each tp pair, FSDP2 over the 4 ranks holding the same experts
    (2, 2, 4, 1, 1, 1),  # ep over all 4 ranks: each holds its E/4 experts whole
    (1, 4, 2, 1, 1, 2),  # no FSDP2 (one data-parallel rank): the 2 tp pairs holding the same experts all-reduce
    (2, 2, 2, 2, 2, 2),  # HSDP: FSDP2 over 2, replicas 2
])
def test_the_expert_groups_are_folded_over_dp_shard_and_tp(shard, tp, ep, replicate, expert_shard, expert_replicate):
    """The expert mesh is cut from dp_shard x cp x tp, tp innermost (runtime/distributed/expert_parallel.py): the ep group is ep
    consecutive ranks (stride 1, over the tp ranks first), the experts' FSDP group the next dp_shard x tp / ep
    (stride ep), the replicas beyond; with or without sequence parallelism (every tp rank routes its own tokens)."""
    ctx = Context(gpt_profile(n_layer=2, seq=1024), cluster(8), Training(8, "bf16"), CP_EP)
    par = Parallelism(dp_replicate=replicate, dp_shard=shard,
                      tp=tp, ep=ep)
    for sp in (False, True):
        groups = ctx.groups(replace(par, sp=sp))
        assert groups.ep == ctx.group(ep, 1)
        assert groups.expert_shard == ctx.group(expert_shard, ep)
        assert groups.expert_replicate.size == expert_replicate


@pytest.mark.parametrize("shard, cp, tp, ep", [(8, 1, 1, 4), (4, 1, 2, 2), (4, 1, 2, 8), (2, 2, 2, 4), (2, 1, 4, 8),
                                               (2, 2, 2, 8)])
def test_expert_states_per_rank_divide_by_every_folded_rank(olmoe_context, shard, cp, tp, ep):
    """N parameters on a tensor-parallel rank, X of them experts (all E, whole on every tp rank: ETP 1), zero=3 over
    dp_shard x cp, bf16 AdamW (2 + 2 + 12 bytes): ep folded over dp_shard x cp x tp leaves each rank E/ep experts,
    FSDP2-sharded over the dp_shard x cp x tp / ep ranks holding them, so the rank keeps 16 X / (dp_shard x cp x tp)
    bytes of expert states, and 16 (N - X) / (dp_shard x cp) of the others. Before folding, ep came from dp_shard x
    cp only and every tp rank held 16 X / (dp_shard x cp)."""
    ctx = olmoe_context
    numel, experts = ctx.total_numel(tp), sum(ctx.expert_numel)
    fsdp = shard * cp
    assert expert_shard_degree(fsdp, ep, tp) == shard * cp * tp // ep
    memory = ctx.layout_memory(ctx.memory_inputs(TableKey(tp, 1, ep=ep)),
                               MemoryLayout(fsdp, True, expert_shard=expert_shard_degree(fsdp, ep, tp)))
    states = sum(sum(memory.states[c]) + sum(memory.tied_states[c]) for c in ("parameters", "gradients",
                                                                                     "optimizer"))
    assert states == pytest.approx(16 * ((numel - experts) / fsdp + experts / (shard * cp * tp)))


def test_the_search_tries_ep_folded_over_the_tensor_parallel_ranks(olmoe_context):
    """On 4 GPUs at tp=4 (one data-parallel rank) the search tries every ep dividing the 8 experts and the 4 folded
    ranks (before, ep had to divide dp x cp = 1), and every layout it keeps is one the rules accept."""
    from autoplan.solve.layouts import scope_of

    ctx = olmoe_context
    result = search(ctx.profile, cluster(4), Training(8, "bf16"), parse_pins("tp=4"),
                    options=SearchOptions(features=CP_EP))
    # every ep is a family the search explores (which of them it prices fully is the branch and bound's call)
    enumerated = {f.ep for f in families(parse_pins("tp=4"), scope_of(result.context))}
    assert enumerated == {1, 2, 4}
    tried = {c.parallelism.ep for c in result.candidates}
    assert tried <= {1, 2, 4}
    four = search(ctx.profile, cluster(4), Training(8, "bf16"), parse_pins("tp=4,ep=4"),
                  options=SearchOptions(features=CP_EP)).best
    assert four.fits and four.parallelism.ep == 4
    assert four.parallelism.tp == 4 and four.parallelism.dp_shard == 1


def test_a_planned_layout_prices_the_folded_expert_states_and_one_route_per_token(olmoe_context):
    """Through the evaluation a plan gets (cost/evaluate.py): at dp_shard 4 x tp 2 the model states of ep=8 (each
    rank 1 of the 8 experts, whole) are smaller than those of ep=1 (the experts sharded over dp_shard 4 only) by
    16 X (1/4 - 1/8) bytes; and with ep > 1 every tp rank routes its own half of the tokens, sequence parallelism or
    not: its all-to-alls move half the rows, and its experts compute half of them."""
    from autoplan.cost.evaluate import build_problem

    ctx = olmoe_context
    par = Parallelism(dp_shard=4, tp=2, reshard=True,
                      sp=False, microbatch=1,
                      microbatches=2)
    experts = sum(ctx.expert_numel)

    def states(ep: int) -> float:
        problem = build_problem(ctx, replace(par, ep=ep), ("none",))
        return sum(sum(problem.memory[0].states[c]) + sum(problem.memory[0].tied_states[c])
                   for c in ("parameters", "gradients", "optimizer"))

    assert states(1) - states(8) == pytest.approx(16 * experts * (1 / 4 - 1 / 8))
    folded = ctx._sharded_modules(2, 1, False, 1, 2)
    assert folded.expert_split == 2
    alone = ctx._sharded_modules(1, 1, False, 1, 2)  # tp 1: the same tokens per rank as each tp rank's half x 2
    assert sum(folded.all_to_all_s) < sum(alone.all_to_all_s)
    # with sequence parallelism the MoE blocks run on each tp rank's sequence shard: their ops' sequence roles divide
    # the experts' compute by tp (not the folded split again), and the all-to-alls move the same half of the rows
    on = ctx._sharded_modules(2, 1, True, 1, 2)
    assert on.expert_split == 1 and sum(on.all_to_all_s) == pytest.approx(sum(folded.all_to_all_s))
    assert sum(on.expert_forward_s) == pytest.approx(sum(folded.expert_forward_s), rel=0.01)


@pytest.mark.parametrize("shard, reshard, expert_shard", [(8, True, 2), (8, False, 1), (1, False, 1)])
def test_expert_states_shard_over_the_fsdp_group_left_after_ep(shard, reshard, expert_shard):
    """(n - e) x 16 / shard + e x 16 / expert_shard bytes with bf16 AdamW (2 + 2 + 12; sharded as zero 3)."""
    n, e = 1000.0, 600.0  # module elements on the rank, of which expert elements (already E/ep)
    inputs = MemoryInputs(module_numel=(n,), group_numel=(), tied_group_modules=(), module_largest_numel=(n,),
                          activations={"none": (0.0,)}, working_bytes=(0.0,), cut_bytes=(), expert_numel=(e,))
    memory = layout_memory(inputs, "bf16", MemoryLayout(shard, reshard, expert_shard=expert_shard))
    states = {c: memory.states[c][0] for c in ("parameters", "gradients", "optimizer")}
    if shard == 1:
        assert states == pytest.approx({"parameters": 2 * n, "gradients": 2 * n, "optimizer": 12 * n})
    elif reshard:
        assert sum(states.values()) == pytest.approx((n - e) * 16 / shard + e * 16 / expert_shard)
    else:  # FSDP2 without resharding: the states sharded as zero 3, and the gathered bf16 copy held to backward
        assert sum(states.values()) == pytest.approx((n - e) * 16 / shard + e * 16 / expert_shard)
        assert memory.states["gathered_parameters"][0] == pytest.approx(2 * n)


def test_context_parallel_halves_activations_and_prices_the_exposed_ring():
    """On a slow link (1 MB/s) the ring hides nothing: per attention layer and micro-batch at cp = 2 the forward
    exposes one K/V block send and the backward one K/V send, one gradient send hidden behind nothing and the
    last gradient block coming home: 2 x (alpha + B / bw) + 2 x (alpha + 2B / bw), B = 2 x b x seq/cp x h x 2 bytes
    (K and V, bf16) and the gradient block in fp32 (2B); at cp = 2 the K,V all-gather is one block's send. The ring's
    per-step merges (microseconds) are within the tolerance."""
    layers, seq, hidden, batch = 2, 1024, 64, 4
    bandwidth, latency = 1e6, 1e-5
    profile = gpt_profile(n_layer=layers, n_embd=hidden, seq=seq, batch=2)
    ctx = Context(profile, cluster(4, intra_bw=bandwidth, latency_s=latency), Training(batch, "bf16"), CP_EP)
    one, two = ctx.table(TableKey(1, 1)), ctx.table(TableKey(1, 1, cp=2))
    assert two.activation_bytes["full"] == pytest.approx(tuple(a / 2 for a in one.activation_bytes["full"]))
    # a rank's modules are priced on its tokens (micro-batch / cp): their FLOPs halve, their kernel launches do not
    assert two.forward_s == pytest.approx(ctx.table(TableKey(1, 1 / 2)).forward_s)
    assert sum(one.forward_s) / 2 < sum(two.forward_s) < sum(one.forward_s)
    block = 2 * 1 * seq / 2 * hidden * 2
    per_layer = 2 * (latency + block / bandwidth) + 2 * (latency + 2 * block / bandwidth)
    assert sum(two.cp_forward_s) + sum(two.cp_backward_s) == pytest.approx(layers * per_layer, rel=1e-3)
    par = Parallelism(dp_shard=2, reshard=True, cp=2,
                      microbatches=2)
    problem = build_problem(ctx, par, ("none",))
    assert problem.memory_cap_bytes > 0
    priced = try_layout(ctx, par, ("none",))
    assert priced.predicted.time_breakdown["context_parallel_comm"] == pytest.approx(2 * layers * per_layer, rel=1e-3)
    whole = with_memory_without_cp_ep(ctx, priced, ("none",)).predicted.peak_memory_without_context_parallel_bytes
    assert whole is not None and whole > priced.predicted.peak_memory_bytes


def test_context_parallel_with_tensor_parallelism_rings_each_ranks_heads_and_gathers_the_sequence_parallel_input():
    """cp = 2 x tp = 2 on the slow link: each tensor-parallel rank's ring carries its half of the heads' keys and
    values (half the sp=off ring of test_context_parallel_halves_activations_and_prices_the_exposed_ring's block);
    with sequence parallelism the first block's input, split over the tp ranks, is all-gathered once to cut the
    cp share (forward, the whole sequence W = b x seq x h x 2 bytes) and its gradient once (backward, W / cp)."""
    from autoplan.cost import comm

    layers, seq, hidden, batch = 2, 1024, 64, 4
    bandwidth, latency = 1e6, 1e-5
    profile = gpt_profile(n_layer=layers, n_embd=hidden, seq=seq, batch=2)
    features = CP_EP | {"tp_fused_split"}  # the fixture's attention is a fused qkv: split it over the tp ranks
    ctx = Context(profile, cluster(4, intra_bw=bandwidth, latency_s=latency), Training(batch, "bf16"), features)
    plain, sp = ctx.table(TableKey(2, 1, cp=2)), ctx.table(TableKey(2, 1, sp=True, cp=2))
    block = 2 * 1 * seq / 2 * hidden / 2 * 2
    per_layer = 2 * (latency + block / bandwidth) + 2 * (latency + 2 * block / bandwidth)
    assert sum(plain.cp_forward_s) + sum(plain.cp_backward_s) == pytest.approx(layers * per_layer, rel=1e-3)
    whole, link = 1 * seq * hidden * 2, ctx.group(2, 1).link
    gathers = comm.all_gather_s(whole, 2, link) + comm.all_gather_s(whole / 2, 2, link)
    extra = sum(sp.cp_forward_s) + sum(sp.cp_backward_s) - sum(plain.cp_forward_s) - sum(plain.cp_backward_s)
    assert extra == pytest.approx(gathers, rel=1e-3)


def test_the_report_names_cp_and_ep_and_shows_memory_with_them_set_back_to_1():
    from dataclasses import replace

    from report_fixtures import make_plan

    from autoplan.report.html import memory_section
    from autoplan.report.rollup import describe_layout

    plan = make_plan(pp=1, dp=2, microbatches=16)
    plan = replace(plan, cluster=replace(plan.cluster, num_gpus=8), parallelism=replace(plan.parallelism, cp=4, ep=2),
                   predicted=replace(plan.predicted, peak_memory_without_context_parallel_bytes=50 * 2**30,
                                     peak_memory_without_expert_parallel_bytes=30 * 2**30))
    name = describe_layout(plan.parallelism)
    assert "CP 4" in name and "EP 2" in name
    html = memory_section(plan)
    assert "Context parallelism" in html and "cp=1 would need 50 GiB" in html
    assert "Expert parallelism" in html and "ep=1 would need 30 GiB" in html
    restored = type(plan).from_json(plan.to_json())  # plan.json round trip with the new fields
    assert restored.parallelism.cp == 4
    assert restored.predicted.peak_memory_without_expert_parallel_bytes == 30 * 2**30


@pytest.mark.parametrize("fsdp, ep, expert_shard", [(64, 8, 8), (8, 2, 4), (2, 2, 1), (1, 2, 1), (4, 8, 1)])
def test_the_experts_shard_over_the_fsdp_ranks_holding_the_same_ones(fsdp, ep, expert_shard):
    """dp_shard x cp / ep (torchtitan's dp_shard_mod_ep, as ExpertParallel.fully_shard runs it); 1 without FSDP or
    when ep takes more than the FSDP ranks."""
    assert expert_shard_degree(fsdp, ep) == expert_shard


@pytest.fixture(scope="module")
def olmoe_context():
    """The tiny OLMoE of benchmarks/zoo (8 experts per layer) priced on 8 GPUs."""
    from pathlib import Path

    from autoplan.hardware.profiles import load_hardware
    from autoplan.profile import profile_model
    from autoplan.contract import load_source

    zoo = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo" / "causal_lm.py"
    hardware = load_hardware("h100-sxm5-80gb")
    profile = profile_model(load_source(f"{zoo}:olmoe"), 2, hardware, measure=False, dtype="bf16")
    return Context(profile, cluster(8), Training(8, "bf16"), CP_EP)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("ep", [1, 4])
def test_expert_states_per_rank_are_those_of_fsdp_without_ep(olmoe_context, reshard, ep):
    """N parameters on a rank, X of them experts (all E), dp_shard 8, bf16 AdamW (2 + 2 + 12 bytes): the rank holds
    X/ep of the experts, FSDP2 shards them over the 8/ep ranks holding the same ones, in fp32 (FSDP2's sharded
    parameter, gradient and AdamW moments: 4 + 4 + 8): parameters 4 ((N - X)/8 + X/ep/(8/ep)) = 4N/8, gradients
    4N/8, optimizer 8N/8, as without ep. zero=2 (no resharding): the same shards, and the gathered bf16 copy
    2 ((N - X) + X/ep) held to backward."""
    ctx = olmoe_context
    numel, experts = ctx.total_numel(1), sum(ctx.expert_numel)
    assert experts > numel / 2  # most of the model is experts
    memory = ctx.layout_memory(ctx.memory_inputs(TableKey(1, 1, ep=ep)),
                               MemoryLayout(8, reshard, expert_shard=expert_shard_degree(8, ep)))
    states = {c: sum(memory.states[c]) + sum(memory.tied_states[c]) for c in ("parameters", "gradients",
                                                                                       "optimizer")}
    assert states == pytest.approx({"parameters": 4 * numel / 8, "gradients": 4 * numel / 8, "optimizer": 8 * numel / 8})
    gathered = sum(memory.states.get("gathered_parameters", ()))
    assert gathered == (0 if reshard else pytest.approx(2 * (numel - experts + experts / ep)))


def test_the_experts_fsdp_collectives_add_to_their_modules_and_hide_behind_the_same_compute():
    """Two modules of b parameter bytes (FSDP over 8), each holding e bytes of experts (FSDP over 2, HSDP replicas
    2), resharding. Per module and micro-batch: two all-gathers of each (g) and one reduce-scatter of each gradient
    (fp32: x2) plus the experts' all-reduce over the replicas (s), alpha + bytes x bus factor / busbw each, and
    three copies of b + e. Nothing to hide behind: 2 x (2g + s) + copies. A compute window W in each pass hides W
    of each pass's collectives beyond the first gather and the last reduction: 2W less (one window for both
    kinds, not one each)."""
    from autoplan.cost import comm

    from test_offload_compile import comm_link

    link, b, e, alpha, bw, copy, window = comm_link(), 4e6, 12e6, 1e-5, 100e9, 1e12, 1e-5
    stage = dict(module_param_bytes=(b, b), reshards_after_forward=True, shard=comm.Group(8, link, 1),
                 replicate=comm.Group(1, link, 1), pipelined=False, microbatches=1, forward_window_s=0.0,
                 backward_window_s=0.0, copy_bytes_per_s=copy, gradient_ratio=2.0, expert_param_bytes=(e, e),
                 expert_shard=comm.Group(2, link, 1), expert_replicate=comm.Group(2, link, 1))
    g = (alpha + b * 7 / 8 / bw) + (alpha + e * 1 / 2 / bw)
    s = (alpha + 2 * b * 7 / 8 / bw) + (alpha + 2 * e * 1 / 2 / bw) + (alpha + 2 * e / 2 * 2 * 1 / 2 / bw)
    copies = 3 * 2 * 2 * (b + e) / copy
    priced = comm.fsdp_comm(comm.FsdpStage(**stage))
    assert priced.per_microbatch_s == pytest.approx(2 * (2 * g + s) + copies)
    assert priced.total_s == pytest.approx(2 * (2 * g + s))
    hidden = comm.fsdp_comm(comm.FsdpStage(**{**stage, "forward_window_s": window, "backward_window_s": window}))
    assert hidden.per_microbatch_s == pytest.approx(2 * (2 * g + s) + copies - 2 * window)


def test_the_summary_says_why_the_experts_are_split():
    """The CLI summary's experts row: the plan's expert compute, all-to-all and peak beside the same layout's with
    ep=1, and the fastest ep=1 layout (plan.json alternatives) with its step time as a multiple of the plan's."""
    from dataclasses import replace

    from report_fixtures import make_plan

    from autoplan.cli import _expert_parallel_line
    from autoplan.plan import Alternative

    plan = make_plan(pp=1, dp=8, microbatches=2)
    single = Alternative(parallelism=plan.parallelism, step_time_s=plan.predicted.step_time_s * 1.25,
                         peak_memory_bytes=70 * 2**30, fits=True, reason="25% slower than the best")
    parts = {**plan.predicted.time_breakdown, "expert_compute": 0.02, "expert_parallel_comm": 0.005}
    plan = replace(plan, parallelism=replace(plan.parallelism, ep=8), alternatives=(single,),
                   predicted=replace(plan.predicted, peak_memory_bytes=60 * 2**30, time_breakdown=parts,
                                     peak_memory_without_expert_parallel_bytes=90 * 2**30))
    line = _expert_parallel_line(plan)
    assert line.startswith("ep=8: 20.0 ms expert compute, 5.0 ms all-to-all, 60.00 GiB peak, the same layout with "
                           "ep=1 90.00 GiB; the fastest layout with ep=1 ("), line
    assert line.endswith("(1.25x), 70.00 GiB"), line


def test_the_summary_names_the_fastest_expert_split_when_the_plan_keeps_the_experts_whole():
    """With ep=1 chosen on a model with experts, the row names the fastest ep > 1 layout of plan.alternatives."""
    from dataclasses import replace

    from report_fixtures import make_plan

    from autoplan.cli import _expert_parallel_line, _has_experts
    from autoplan.plan import Alternative

    plan = make_plan(pp=1, dp=8, microbatches=2)
    split = Alternative(parallelism=replace(plan.parallelism, ep=4),
                        step_time_s=plan.predicted.step_time_s * 1.5, peak_memory_bytes=50 * 2**30, fits=True,
                        reason="50% slower than the best")
    parts = {**plan.predicted.time_breakdown, "expert_compute": 0.02}
    plan = replace(plan, alternatives=(split,), predicted=replace(plan.predicted, peak_memory_bytes=60 * 2**30,
                                                                   time_breakdown=parts))
    assert _has_experts(plan) and not _has_experts(make_plan(pp=1, dp=8, microbatches=2))
    line = _expert_parallel_line(plan)
    assert line.startswith("ep=1: 20.0 ms expert compute, 60.00 GiB peak; the fastest layout with ep > 1 ("), line
    assert line.endswith("(1.50x), 50.00 GiB"), line


def test_pipeline_sends_carry_the_rank_share_from_the_first_attention_module_on():
    """Under cp the program hands each rank its share of the sequence where the block of the first attention call
    starts: a boundary before it carries the whole sequence on every cp rank, every later one 1/cp of it."""
    profile = gpt_profile(n_layer=2, seq=1024, batch=2)
    ctx = Context(profile, cluster(4), Training(4, "bf16"), CP_EP)
    first = min(ctx._attention_module)
    assert first > 0  # the embeddings come before
    whole, shared = ctx.cut_bytes(2), ctx.rank_cut_bytes(2)
    assert shared[:first] == whole[:first]
    assert shared[first:] == pytest.approx(tuple(c / 2 for c in whole[first:]))
    assert ctx.rank_cut_bytes(1) == ctx.cut_bytes(1)
    inputs = ctx.memory_inputs(TableKey(1, 1, cp=2))
    assert inputs.cut_bytes == pytest.approx(tuple(c * ctx.scale for c in shared))


def test_compiled_pipeline_stages_holding_experts_are_refused_with_the_reason():
    """torch.compile of a pipeline stage with expert layers fails in inductor here (a tiny examples/mixtral.py at
    pp=2 x dp=2 stopped with "NYI SymInt equality" under autoplan verify, ep 1 and 2): the rule keeps the search
    from emitting it and refuses the pin; without experts, or without a pipeline, compile stays allowed."""
    scope = Scope(features=SUPPORTED, num_experts=(4, 4))
    assert problems(Layout(compile="on", pp=2), scope) == [
        "compile=on with pp=2 on a model with expert layers: torch.compile of its pipeline stages fails in the "
        "experts' backward (inductor: NYI SymInt equality; use compile=off or pp=1)"]
    assert problems(Layout(compile="on", pp=1), scope) == []
    assert problems(Layout(compile="on", pp=2), Scope(features=SUPPORTED, num_experts=())) == []
    assert problems(Layout(compile="on", pp=2), Scope(features=ALL_FEATURES, num_experts=(4,))) == []  # priced


def test_compiled_experts_with_tensor_parallelism_are_refused_with_the_reason():
    """Compiled, a mixture of experts at tp=2 lost loss parity in the pairs matrix (HF Mixtral, step 2): the rule
    keeps the search from emitting it; eager, or compiled without tp, or without experts, stays allowed."""
    scope = Scope(features=SUPPORTED, num_experts=(4, 4))
    assert problems(Layout(compile="on", tp=2), scope) == [
        "compile=on with tp=2 on a model with expert layers: the compiled program loses loss parity with the "
        "single-device model (use compile=off or tp=1)"]
    assert problems(Layout(compile="off", tp=2), scope) == []
    assert problems(Layout(compile="on", tp=1), scope) == []
    assert problems(Layout(compile="on", tp=2), Scope(features=SUPPORTED, num_experts=())) == []
    assert problems(Layout(compile="on", tp=2), Scope(features=ALL_FEATURES, num_experts=(4,))) == []  # priced


def test_with_cp_and_tp_the_experts_token_split_is_only_expert_parallel_routing(tmp_path):
    """ShardedModules.expert_split (tp ranks routing their own share of the tokens, beyond what the experts' ops'
    own roles price) is tp only with ep > 1 (one route per token, runtime/distributed/expert_parallel.py TensorParallelTokens);
    the ring's per-call head split under tp (HF Llama's attention runs inside its tensor-parallel region) must not
    leak into it, or an ep=1 layout's expert compute would be divided by tp."""
    from autoplan.hardware.profiles import load_hardware
    from autoplan.profile import profile_model
    from autoplan.contract import load_source

    from test_layouts import TINY_LLAMA

    model = tmp_path / "llama.py"
    model.write_text(TINY_LLAMA)
    profile = profile_model(load_source(str(model)), 2, load_hardware("h100-sxm5-80gb"), measure=False, dtype="bf16")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), CP_EP)
    assert {ctx.facts.role.get(call.node) for call in ctx.attention.calls} == {"interior"}  # heads split over tp
    assert ctx._sharded_modules(2, 1, True, 2, 1).expert_split == 1
    assert ctx._sharded_modules(2, 1, True, 1, 2).expert_split == 2
    assert ctx._sharded_modules(2, 1, False, 2, 2).expert_split == 2
    assert ctx._sharded_modules(2, 1, False, 2, 1).expert_split == 1
    assert not ctx._experts_on_shards  # no expert op runs on sequence shards (a dense model)


@pytest.mark.parametrize("ep", [1, 4])
def test_expert_compute_is_its_own_part_of_the_step_and_the_parts_still_sum_to_it(olmoe_context, ep):
    """time_breakdown["expert_compute"]: the experts' ops out of "compute" (the busiest expert-parallel rank's at
    ep > 1), m micro-batches of Context.expert_compute_s on one stage; the parts still sum to the step time, and
    the model's expert compute plus the rest equals the compute priced before the split."""
    from autoplan.cost.evaluate import build_problem, evaluate
    from autoplan.cost.problem import Split

    ctx = olmoe_context
    par = Parallelism(dp_shard=8, reshard=True, ep=ep,
                      microbatch=1, microbatches=1)
    problem = build_problem(ctx, par, ("none",))
    predicted = evaluate(ctx, par, problem, problem.uniform(Split((0, len(ctx.chain)))), True).predicted
    parts = predicted.time_breakdown
    assert sum(parts.values()) == pytest.approx(predicted.step_time_s)
    expert = sum(ctx.expert_compute_s(TableKey(1, 1, ep=ep)))
    assert parts["expert_compute"] == pytest.approx(expert) and expert > 0
    table = ctx.table(TableKey(1, 1, False, True, 1, ep))
    assert parts["compute"] + parts["expert_compute"] == pytest.approx(sum(table.forward_s) + sum(table.backward_s))


def test_the_search_prices_the_fastest_layout_without_expert_parallelism_beside_the_plan(olmoe_context):
    """On 8 GPUs the search prices the fastest layout of the other kind than its plan's (ep=1 beside an ep > 1 plan,
    or the reverse) even where the branch and bound stopped before it; the plan's alternatives carry it (solve/alternatives.py) and
    the report's experts section shows both with the candidates' expert compute, all-to-all and memory."""
    from autoplan.solve.alternatives import fastest_of_the_other_expert_split
    from autoplan.report.html import experts_section
    from autoplan.report.svg import fmt_bytes, fmt_seconds

    result = search(olmoe_context.profile, cluster(8), Training(8, "bf16"), parse_pins(""),
                    options=SearchOptions(features=CP_EP))
    best = result.best
    other = fastest_of_the_other_expert_split(result.candidates, best)
    assert len(other) == 1 and other[0].fits
    assert (other[0].parallelism.ep > 1) != (best.parallelism.ep > 1)
    assert other[0] in result.candidates
    section = experts_section(None, result.candidates, best)
    rows = section.split("<tr")[2:]
    assert len(rows) == 2
    for row, c in zip(rows, sorted((best, other[0]), key=lambda c: c.parallelism.ep == 1)):
        parts = c.predicted.time_breakdown
        assert parts["expert_compute"] > 0
        assert f">{fmt_seconds(c.predicted.step_time_s)}<" in row
        assert f">{fmt_seconds(parts['expert_compute'])}<" in row
        assert f">{fmt_seconds(parts.get('expert_parallel_comm', 0.0))}<" in row
        assert f">{fmt_bytes(c.predicted.peak_memory_bytes)}<" in row
    split = best if best.parallelism.ep > 1 else other[0]
    assert split.predicted.time_breakdown["expert_parallel_comm"] > 0


def test_a_default_compile_the_rules_refuse_for_a_layout_is_off_for_it_wherever_it_is_priced(tmp_path):
    """compile is on by default for GPUs; the rule against compile=on with recompute over tensor-parallel shards in
    the ring refuses some layouts compiled. The search prices each layout as the program runs it (search.runnable):
    tp=2 x cp=2 with full recompute is planned uncompiled, a program that runs, and its compiled twin is listed with
    the rule it breaks (unpinned, at full size: tests/test_plan_cp_ep_slow.py)."""
    from autoplan.hardware.profiles import load_hardware
    from autoplan.profile import profile_model
    from autoplan.solve import layouts
    from autoplan.contract import load_source

    from test_layouts import TINY_LLAMA

    model = tmp_path / "llama.py"
    model.write_text(TINY_LLAMA)
    profile = profile_model(load_source(str(model)), 2, load_hardware("h100-sxm5-80gb"), measure=False, dtype="bf16")
    result = search(profile, cluster(4), Training(8, "bf16"), parse_pins("tp=2,cp=2,recompute=full"),
                    options=SearchOptions(features=CP_EP))
    best, scope = result.best, layouts.scope_of(result.context)
    assert not best.compile and best.fits
    assert problems(replace(best.parallelism.layout(), compile="off"), scope) == []
    compiled = [c for c in result.candidates if c.compile and c.parallelism == best.parallelism]
    assert len(compiled) == 1 and "but the program cannot run it: compile=on with recompute=full at tp=2" in (
        compiled[0].reason)
    # pinned on, the pins cannot hold (the rule, before any search)
    with pytest.raises(UserError, match="compile=on with recompute=full at tp=2"):
        search(profile, cluster(4), Training(8, "bf16"), parse_pins("tp=2,cp=2,recompute=full,compile=on"),
               options=SearchOptions(features=CP_EP))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_memory_without_cp_and_ep_reads_the_rank_that_runs_the_peak_stage_in_the_v(schedule):
    """The report's "without cp" memory is the cp = 1 memory of the rank that runs the peak stage: under zbv and
    dualpipev stage s >= pp runs on rank 2 pp - 1 - s (Parallelism.stage_rank), not s % pp. Stage pp (rank pp - 1 in
    the V, rank 0 in loop order) is made the peak, so reading the loop's rank gives another rank's memory."""
    profile = gpt_profile(n_layer=8, seq=256, batch=2)
    ctx = Context(profile, cluster(8), Training(8, "bf16"), ALL_FEATURES)
    par = Parallelism(dp_shard=2, reshard=True, cp=2, pp=2, schedule=schedule, virtual_stages=2, microbatches=4)
    priced = try_layout(ctx, par, ("none",))
    assert priced is not None and priced.assignment is not None and len(priced.stages) == 4
    peak_stage = par.pp
    stages = tuple(replace(st, predicted_memory_bytes=1.0 if st.index == peak_stage else 0.0) for st in priced.stages)
    whole = with_memory_without_cp_ep(ctx, replace(priced, stages=stages), ("none",)).predicted
    plain = build_problem(ctx, replace(par, cp=1), ("none",))
    by_rank = [sum(plain.rank_breakdown(r, priced.assignment).values()) for r in range(par.pp)]
    assert par.stage_rank(peak_stage) == par.pp - 1 != peak_stage % par.pp
    assert by_rank[0] != pytest.approx(by_rank[1])  # the two ranks differ, so reading the wrong one shows
    assert whole.peak_memory_without_context_parallel_bytes == pytest.approx(by_rank[par.pp - 1])
