"""Cost model: memory against ZeRO and Korthikanti closed forms, schedules, compute, collectives, MFU."""

from dataclasses import replace

import pytest
from chain_fixtures import LAUNCH_S, cluster, gpt_profile, make_gpu

from autoplan.cost.context import TableKey
from autoplan.cost import comm
from autoplan.cost.compute import LOSS_KERNELS, TableSetting, mfu, module_table
from autoplan.cost.context import Context, Pricing
from autoplan.cost.dtypes import peak_flops
from autoplan.cost.evaluate import build_problem, evaluate
from autoplan.cost.memory import model_state_bytes
from autoplan.cost.pipeline import StageCost, microbatches_in_flight, pipeline_time, simulate, simulated_step_s
from autoplan.cost.problem import Split
from autoplan.errors import UserError
from autoplan.hardware.types import Link
from autoplan.layout import ALL_FEATURES, SUPPORTED, Layout
from autoplan.plan import Parallelism, Training
from autoplan.solve.search import SearchOptions, search

PSI = 1_000_000


def _par(dp=1, pp=1, zero=0, schedule="1f1b", mbs=1, m=1, tp=1, v=1, replicate=None):
    shard = 1 if zero == 0 else dp // (replicate or 1)
    return Parallelism(dp_replicate=dp // shard, dp_shard=shard,
                       reshard=zero == 3,
                       tp=tp, pp=pp, schedule=schedule,
                       microbatch=mbs, microbatches=m,
                       virtual_stages=v)


def _ctx(profile=None, gpus=8, batch=8, dtype="bf16", features=SUPPORTED, **kw):
    return Context(profile or gpt_profile(n_layer=12), cluster(gpus, **kw), Training(batch, dtype), features)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_states_match_the_zero_closed_forms(dtype):
    nd, k = 8, 12  # ZeRO paper: mixed-precision Adam keeps K = 12 bytes of optimizer state
    assert sum(model_state_bytes(PSI, dtype, 0, nd).values()) == 16 * PSI
    assert sum(model_state_bytes(PSI, dtype, 3, nd).values()) == pytest.approx(16 * PSI / nd)
    if dtype == "bf16":
        assert sum(model_state_bytes(PSI, dtype, 1, nd).values()) == pytest.approx(4 * PSI + k * PSI / nd)
        assert sum(model_state_bytes(PSI, dtype, 2, nd).values()) == pytest.approx(2 * PSI + (2 + k) * PSI / nd)


def _states(ctx, par, start=0, end=None):
    problem = build_problem(ctx, par, ("none",))
    end = len(ctx.chain) if end is None else end
    part = problem.memory[0].end_of_backward_breakdown(start, end)  # every state alive, gathered units
    return part, sum(part.get(c, 0.0) for c in ("parameters", "gradients", "optimizer"))


def test_whole_model_states_are_16_psi_replicated_16_psi_over_n_sharded_and_zero1_runs_as_zero2():
    ctx = _ctx()
    psi = ctx.chain.parameter_numel
    assert _states(ctx, _par(dp=8))[1] == pytest.approx(16 * psi)
    fsdp, total = _states(ctx, _par(dp=8, zero=3))
    assert total == pytest.approx(16 * psi / 8)
    largest = max(u.parameter_numel for u in ctx.chain.modules)
    assert fsdp["gathered_parameters"] == pytest.approx(2 * 2 * largest)  # bf16, computing + prefetched module
    unsharded, total = _states(ctx, _par(dp=8, zero=1))  # FSDP2 without reshard: the gathered copy to backward
    assert total == pytest.approx(16 * psi / 8) and unsharded["gathered_parameters"] == pytest.approx(2 * psi)
    assert _states(ctx, _par(dp=8, zero=3, replicate=2))[1] == pytest.approx(16 * psi / 4)  # HSDP 2 x 4


def test_fsdp_under_a_pipeline_holds_the_stage_unsharded():
    ctx = _ctx(dtype="fp32")
    part, _ = _states(ctx, _par(dp=4, pp=2, zero=3, m=4), 2, 8)
    numel = sum(u.parameter_numel for u in ctx.chain.modules[2:8])
    assert part["gathered_parameters"] == part["unsharded_gradients"] == pytest.approx(4 * numel)
    assert part["optimizer"] == pytest.approx(8 * numel / 4)


def test_tensor_parallel_splits_the_paired_linears_and_the_vocabulary():
    ctx = _ctx(features=ALL_FEATURES)
    block = ctx.chain.modules[2]
    h = 128
    split = 3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h  # qkv, proj, fc, proj (+ colwise biases)
    assert ctx.costs.modules[2].split_numel == split
    assert ctx.module_numel(4)[2] == pytest.approx(block.parameter_numel - split + split / 4)
    assert ctx.costs.tied_split == (True,)  # wte rowwise + lm_head colwise: the tied weight splits too
    assert _ctx().costs.tied_split == (True,)  # codegen runs the vocabulary-parallel pair too
    assert _ctx(features=SUPPORTED - {"tp_vocab_parallel"}).costs.tied_split == (False,)  # without it: whole


def test_tied_parameters_are_held_once_per_stage_that_uses_them():
    ctx = _ctx(dtype="fp32")
    tied = ctx.chain.tied_groups[0].numel
    whole = _states(ctx, _par())[0]["parameters"]
    first, last = _states(ctx, _par(), 0, 2)[0]["parameters"], _states(ctx, _par(), 15, 16)[0]["parameters"]
    assert whole == pytest.approx(4 * ctx.chain.parameter_numel)
    modules = ctx.chain.modules
    assert first + last == pytest.approx(4 * (modules[0].parameter_numel + modules[1].parameter_numel + tied))


def test_in_flight_micro_batches_per_schedule():
    assert [microbatches_in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    assert [microbatches_in_flight("gpipe", 4, 8, s) for s in range(4)] == [8, 8, 8, 8]
    assert microbatches_in_flight("gpipe", 1, 8, 0) == 1  # gradient accumulation
    # interleaved, p=4, v=2, m=8: rank 0 warms up with (v-1)p + 2(p-1) = 10 forwards (torch)
    # in rounds of 4 per local stage: 4 on stage 0, 4 on stage 4, then 3 more on stage 0 (11 issued)
    assert [microbatches_in_flight("interleaved", 4, 8, s, 2) for s in (0, 4)] == [7, 4]
    assert [microbatches_in_flight("interleaved", 4, 8, s, 2) for s in (3, 7)] == [4, 1]  # 4 + 0 warm-up, +1


def test_activation_memory_per_layer_follows_korthikanti():
    """Megatron-shaped GPT, bf16, per layer: s b h (10 + 24/t + 5 a s / (h t)) bytes kept without
    recompute; full recompute keeps the layer input 2 s b h (Korthikanti et al. 2022, Table 2)."""
    s, h, a = 64, 256, 8
    profile = gpt_profile(n_layer=8, n_embd=h, vocab=512, seq=s, batch=2, n_head=a, device="testgpu",
                          attention="megatron")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED | {"tp_fused_split"})  # Megatron qkv
    block = ctx.chain.fqns.index("blocks.1")
    for t in (1, 2, 4):
        acts = ctx.table(TableKey(t, 1)).activation_bytes
        korthikanti = s * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert acts["none"][block] == pytest.approx(korthikanti, rel=0.01)  # + LayerNorm statistics
        assert acts["full"][block] == pytest.approx(2 * s * h)
        assert acts["full"][block] < acts["selective"][block] < acts["none"][block]


def test_sequence_parallel_activation_memory_per_layer_follows_korthikanti_eq4():
    """TP + SP keeps s b h (34/t + 5 a s / (h t)) per layer (Korthikanti et al. 2022, Eq. 4): norm inputs,
    dropout masks and the inputs the column-parallel Linears all-gather are all kept as sequence shards
    (runtime/distributed/sequence_gather.py gathers again in backward). Full recompute keeps the layer's sequence-sharded
    input, 2 s b h / t."""
    s, h, a = 64, 256, 8
    profile = gpt_profile(n_layer=8, n_embd=h, vocab=512, seq=s, batch=2, n_head=a, device="testgpu",
                          attention="megatron")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED | {"tp_fused_split"})  # Megatron qkv
    assert ctx.facts.sequence_parallel_problem == ""
    block = ctx.chain.fqns.index("blocks.1")
    for t in (2, 4, 8):
        acts = ctx.table(TableKey(t, 1, sp=True)).activation_bytes
        eq4 = s * h * (34 / t + 5 * a * s / (h * t))
        assert acts["none"][block] == pytest.approx(eq4, rel=0.03)  # + LayerNorm statistics
        assert acts["full"][block] == pytest.approx(2 * s * h / t)
        without = ctx.table(TableKey(t, 1)).activation_bytes["none"][block]
        assert without - acts["none"][block] == pytest.approx(10 * s * h * (1 - 1 / t), rel=0.01)  # Eq. 2 - Eq. 4


def test_sequence_parallel_layer_gathers_and_reduce_scatters_instead_of_all_reducing():
    profile = gpt_profile(n_layer=12, device="testgpu")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED | {"tp_fused_split"})  # Megatron qkv
    table, plain = ctx.table(TableKey(4, 2, sp=True)), ctx.table(TableKey(4, 2))
    link, nbytes = ctx.group(4, 1).link, 2 * 64 * 128 * 2  # b s h elements, bf16
    pair = comm.all_gather_s(nbytes, 4, link) + comm.reduce_scatter_s(nbytes, 4, link)
    assert table.tp_forward_s[2] == pytest.approx(2 * pair)  # qkv and fc gather, proj and fc2 reduce-scatter
    # backward: proj and fc2 gather their output gradients, qkv and fc reduce-scatter their input gradients and
    # gather again the inputs they kept as shards
    assert table.tp_backward_s[2] == pytest.approx(2 * pair + 2 * comm.all_gather_s(nbytes, 4, link))
    assert table.forward_s[2] < plain.forward_s[2]  # the norms, adds and dropouts run on sequence shards
    compiled = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED | {"tp_fused_split"}, Pricing(compiled=True))
    assert compiled.table(TableKey(4, 2, sp=True)).tp_backward_s[2] == pytest.approx(2 * pair)  # compiled: kept whole


def test_sequence_parallel_linears_reading_one_tensor_share_its_gather():
    """HF Llama's q, k and v (gate and up) read one normed tensor: one all-gather each way, as
    runtime/distributed/sequence_gather.py runs it, and one shard kept."""
    from pathlib import Path

    from autoplan.profile_data import ModelProfile

    fixtures = Path(__file__).parent / "fixtures"
    profile = ModelProfile.from_json((fixtures / "llama_capture.json").read_text())
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED)
    attention, mlp = (ctx.chain.fqns.index(f"model.layers.0.{name}") for name in ("self_attn", "mlp"))
    link, table, per_mb = ctx.group(2, 1).link, ctx.table(TableKey(2, 1, sp=True)), ctx.scale  # one sample, in bf16
    for u, readers in ((attention, [False, True, True]), (mlp, [False, True])):  # q k v; gate up
        ops = ctx.costs.modules[u].ops
        colwise = [op for op in ops if op.tp_role == "colwise"]
        assert [op.shares_gather for op in colwise] == readers
        (rowwise,) = [op for op in ops if op.tp_role == "rowwise"]
        gathered = colwise[0].input_activation_bytes * per_mb
        assert table.tp_forward_s[u] == pytest.approx(
            comm.all_gather_s(gathered, 2, link) + comm.reduce_scatter_s(rowwise.output_bytes * per_mb, 2, link))
        assert table.tp_backward_s[u] == pytest.approx(  # the input: reduce-scatter, gather again; the output
            comm.reduce_scatter_s(gathered, 2, link) + comm.all_gather_s(gathered, 2, link)
            + comm.all_gather_s(rowwise.output_bytes * per_mb, 2, link))


def test_vocabulary_parallel_head_divides_its_time_weights_and_logits_by_tp():
    """The head's matmul, its weight (tied with the embedding) and the loss's copies of its logits divide by
    tp; its collectives are the loss-parallel reductions, one fp32 number per token each (3), or, with loss
    parallel off, the all-gather of the logits."""
    seq, vocab, b = 512, 32768, 8
    profile = gpt_profile(n_layer=2, n_embd=1024, vocab=vocab, seq=seq, n_head=16, device="testgpu")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED)
    head = ctx.chain.fqns.index("lm_head")
    one, four = ctx.table(TableKey(1, b)), ctx.table(TableKey(4, b))
    assert [op.tp_role for op in ctx.costs.modules[head].ops if op.kind == "gemm"] == ["head"]
    for seconds, kernels in ((lambda t: t.forward_s[head], LOSS_KERNELS[0]),  # launches aside: the loss_fn's
                             (lambda t: t.backward_s[head], LOSS_KERNELS[1])):  # (cost.compute.loss_s) too
        launches = kernels * ctx.cluster.gpu.kernel_overhead_s
        assert seconds(four) - launches == pytest.approx((seconds(one) - launches) / 4, rel=0.02)
    def logits(table):  # the loss's copies of the logits: the module's working bytes beyond its saved ones
        return table.working_bytes[head] - table.activation_bytes["none"][head]

    assert logits(one) > 0 and logits(four) == pytest.approx(logits(one) / 4)
    assert ctx.group_numel(4) == [g.numel / 4 for g in ctx.chain.tied_groups]  # the tied wte / lm_head weight
    link, tokens = ctx.group(4, 1).link, b * seq
    assert four.tp_forward_s[head] == pytest.approx(3 * comm.all_reduce_s(tokens * 4, 4, link))
    gathered = module_table(ctx.costs, replace(_setting(ctx, 4, b), loss_parallel=False))
    assert gathered.tp_forward_s[head] == pytest.approx(comm.all_gather_s(tokens * vocab * 2, 4, link))


def _setting(ctx, tp, microbatch):
    return TableSetting(gpu=ctx.cluster.gpu, capture_dtype=ctx.chain.capture_dtype, train_dtype=ctx.dtype, tp=tp,
                        microbatch=microbatch, tp_link=ctx.group(tp, 1).link, use_measured=ctx.use_measured)


def test_recompute_costs_the_forward_it_repeats():
    ctx = _ctx()
    table = ctx.table(TableKey(1, 2))
    none, selective, full = (table.time_s(m)[2] for m in ("none", "selective", "full"))
    assert full - none == pytest.approx(table.forward_s[2])
    assert selective - none == pytest.approx(table.cheap_forward_s[2]) and 0 < selective - none < full - none


def test_tensor_parallel_layer_all_reduces_twice_forward_and_twice_backward():
    profile = gpt_profile(n_layer=12, device="testgpu")
    ctx = Context(profile, cluster(8), Training(8, "bf16"), SUPPORTED | {"tp_fused_split"})  # Megatron qkv
    table = ctx.table(TableKey(4, 2))
    one = comm.all_reduce_s(2 * 64 * 128 * 2, 4, ctx.group(4, 1).link)  # b s h elements, bf16
    assert table.tp_forward_s[2] == pytest.approx(2 * one)
    assert table.tp_backward_s[2] == pytest.approx(2 * one)
    assert ctx.table(TableKey(1, 2)).tp_forward_s[2] == 0.0
    assert table.forward_s[2] < ctx.table(TableKey(1, 2)).forward_s[2]  # split matmuls and attention


def test_roofline_times_scale_with_dtype_and_measured_times_keep_launches_fixed():
    gpu_ctx = _ctx(gpt_profile(n_layer=12, device="testgpu"))
    fp32 = Context(gpu_ctx.profile, gpu_ctx.cluster, Training(8, "fp32"), SUPPORTED)
    assert all(b < f for b, f in zip(gpu_ctx.table(TableKey(1, 1)).time_s("none"), fp32.table(TableKey(1, 1)).time_s("none")))
    cpu = Context(gpt_profile(n_layer=12, batch=4), replace(cluster(8), hardware=replace(
        cluster(8).hardware, gpu=replace(make_gpu(), name="cpu"))), Training(8, "fp32"), SUPPORTED)
    assert cpu.use_measured
    one, two, four = (cpu.table(TableKey(1, b)).forward_s[2] for b in (1, 2, 4))
    launches = sum(1 for n in cpu.chain.modules[2].ops if not n.startswith(("split", "view", "transpose"))) * LAUNCH_S
    assert two - one == pytest.approx(one - launches, rel=1e-6)  # only the part above the launches grows
    assert four == pytest.approx(cpu.chain.modules[2].time_fwd_s * 4)  # the profiled batch: as measured


def test_bubble_is_p_minus_1_over_v_m_of_the_ideal_time():
    timing = pipeline_time(slot_s=2.0, pp=4, microbatches=8)
    assert timing.bubble_s / timing.busy_s == pytest.approx(3 / 8) and timing.total_s == pytest.approx(22.0)
    interleaved = pipeline_time(slot_s=2.0, pp=4, microbatches=8, virtual_stages=2)
    assert interleaved.bubble_s / interleaved.busy_s == pytest.approx(3 / 16)


def test_priced_pipeline_is_its_simulated_schedule_when_communication_is_free():
    ctx = _ctx(batch=8, gpus=4, intra_bw=1e30, inter_bw=1e30, latency_s=0.0)
    par = _par(pp=4, m=8)
    problem = build_problem(ctx, par, ("none",))
    candidate = evaluate(ctx, par, problem, problem.uniform(Split((0, 5, 8, 11, 16))), True)
    times = candidate.predicted.time_breakdown
    assert times["pipeline_comm"] == pytest.approx(0.0, abs=1e-12)
    costs = [StageCost(s.predicted_forward_s, s.predicted_time_s - s.predicted_forward_s) for s in candidate.stages]
    pipeline = candidate.predicted.step_time_s - times["optimizer"]
    assert pipeline == pytest.approx(simulate("1f1b", 4, 8, costs).makespan_s)
    slowest = max(s.predicted_time_s for s in candidate.stages)
    # unequal stages: the slowest rank waits less than (p - 1) of its own slots to fill and drain
    assert 8 * slowest < pipeline < (8 + 4 - 1) * slowest
    assert times["bubble"] == pytest.approx(pipeline - 8 * slowest)


def test_pipelined_stages_compute_slower_by_the_calibrated_fraction():
    free = _ctx(batch=8, gpus=4, intra_bw=1e30, inter_bw=1e30, latency_s=0.0)
    hardware = free.cluster.hardware
    slowed_hardware = replace(hardware, gpu=replace(hardware.gpu, pipeline_compute_slowdown=0.25))
    slowed = Context(gpt_profile(n_layer=12), replace(free.cluster, hardware=slowed_hardware), Training(8, "bf16"),
                     SUPPORTED)
    par, split = _par(pp=4, m=8), Split((0, 5, 8, 11, 16))
    before, after = (evaluate(c, par, build_problem(c, par, ("none",)),
                              build_problem(c, par, ("none",)).uniform(split), True) for c in (free, slowed))
    # free transfers, no host time: every stage's forward and backward 1.25x, so the whole schedule is
    pipeline = before.predicted.step_time_s - before.predicted.time_breakdown["optimizer"]
    assert after.predicted.step_time_s - after.predicted.time_breakdown["optimizer"] == pytest.approx(1.25 * pipeline)
    assert after.predicted.time_breakdown["pipeline_comm"] == pytest.approx(
        0.25 * before.predicted.time_breakdown["compute"])
    # without a pipeline nothing changes
    dp = _par(dp=4)
    plain = [evaluate(c, dp, build_problem(c, dp, ("none",)), build_problem(c, dp, ("none",)).uniform(Split((0, 16))),
                      True).predicted.step_time_s for c in (free, slowed)]
    assert plain[0] == plain[1]


def test_every_step_pays_one_latency_bound_all_reduce_of_its_loss():
    ctx = _ctx(batch=8, gpus=4, intra_bw=1e30, inter_bw=1e30, latency_s=0.001)
    world = ctx.group(4, 1)
    expected = comm.all_reduce_s(4, 4, world.link, world.nodes)
    assert expected >= 0.001  # at least the link's latency: the bytes are nothing
    for par, split in ((_par(dp=4), Split((0, 16))), (_par(pp=4, m=8), Split((0, 5, 8, 11, 16)))):
        problem = build_problem(ctx, par, ("none",))
        times = evaluate(ctx, par, problem, problem.uniform(split), True).predicted.time_breakdown
        # train.py logs the global mean loss: one fp32 scalar all-reduced over every rank
        assert times["loss_all_reduce"] == pytest.approx(expected)
    alone = _ctx(batch=8, gpus=1)
    problem = build_problem(alone, _par(), ("none",))
    times = evaluate(alone, _par(), problem, problem.uniform(Split((0, 16))), True).predicted.time_breakdown
    assert times["loss_all_reduce"] == 0.0


@pytest.mark.parametrize("schedule, ranks, chunks, microbatches", [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 2), ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 6)])
def test_simulated_pipeline_of_equal_stages_has_the_textbook_bubble(schedule, ranks, chunks, microbatches):
    stages = [StageCost(0.01 / chunks, 0.02 / chunks)] * (ranks * chunks)
    expected = pipeline_time(0.03, ranks, microbatches, chunks).total_s
    assert simulate(schedule, ranks, microbatches, stages).makespan_s == pytest.approx(expected)
    assert simulated_step_s(schedule, ranks, microbatches, stages) == pytest.approx(expected)


def test_simulated_transfers_sit_on_the_critical_path():
    # one micro-batch over two ranks: F0, send, F1, B1, send back, B0
    stages = [StageCost(1.0, 2.0, send_s=0.5), StageCost(3.0, 4.0)]
    assert simulate("1f1b", 2, 1, stages).makespan_s == pytest.approx(1 + 0.5 + 3 + 4 + 0.5 + 2)
    # 1F1B's steady state waits a round trip per micro-batch when transfers are slow
    fast = simulate("1f1b", 2, 16, [StageCost(1.0, 2.0, 0.0), StageCost(1.0, 2.0)]).makespan_s
    slow = simulate("1f1b", 2, 16, [StageCost(1.0, 2.0, 1.0), StageCost(1.0, 2.0)]).makespan_s
    assert slow - fast > 15 * 1.0


def test_long_pipelines_are_extrapolated_from_shorter_simulations():
    stages = [StageCost(0.01 * (1 + 0.2 * (s % 3)), 0.02, 0.002) for s in range(8)]
    for schedule, ranks, microbatches in [("1f1b", 8, 600), ("interleaved", 4, 600), ("gpipe", 8, 300)]:
        exact = simulate(schedule, ranks, microbatches, stages).makespan_s
        assert simulated_step_s(schedule, ranks, microbatches, stages) == pytest.approx(exact, rel=0.01)


def test_collectives_follow_the_alpha_beta_bus_factors():
    link = Link("l", 100e9, 1e-5, "test")
    nbytes = 1e9
    assert comm.all_reduce_s(nbytes, 8, link) == pytest.approx(1e-5 + 2 * 7 / 8 * nbytes / 100e9)
    assert comm.all_gather_s(nbytes, 4, link) == pytest.approx(1e-5 + 3 / 4 * nbytes / 100e9)
    assert comm.all_gather_s(nbytes, 4, link, nodes=4) == pytest.approx(2e-5 + 3 / 4 * nbytes / 100e9)
    assert comm.all_reduce_s(nbytes, 1, link) == 0.0
    assert comm.p2p_s(nbytes, link) == pytest.approx(1e-5 + nbytes / 100e9)
    assert comm.exposed_s(total_s=10, serial_s=1, window_s=4) == 6
    assert comm.exposed_s(total_s=10, serial_s=1, window_s=20) == 1


def test_ddp_overlaps_everything_but_the_last_bucket():
    group = comm.Group(8, Link("l", 100e9, 0.0, "test"))
    grads = 40 * comm.DDP_BUCKET_BYTES
    hidden = comm.ddp_comm(grads, group, backward_window_s=1e3)
    assert hidden.per_step_s == pytest.approx(comm.all_reduce_s(comm.DDP_BUCKET_BYTES, 8, group.link))
    exposed = comm.ddp_comm(grads, group, backward_window_s=0.0)
    assert exposed.per_step_s == pytest.approx(comm.all_reduce_s(grads, 8, group.link))
    assert comm.ddp_comm(grads, comm.Group(1, group.link), 0.0).per_step_s == 0.0


def test_groups_follow_the_mesh_order_and_use_every_nic_of_a_node():
    ctx = _ctx(gpus=64)
    groups = ctx.groups(_par(dp=8, pp=2, tp=4, zero=3, replicate=2))
    assert groups.tp.link.name == "nvlink" and groups.tp.nodes == 1  # tp innermost, inside a node
    assert groups.shard.size == 4 and groups.shard.link.name == "infiniband" and groups.shard.nodes == 2
    assert groups.shard.link.bus_bandwidth_bytes_per_s == pytest.approx(2 * 20e9)  # 2 GPUs per node, 2 NICs
    assert groups.pipeline.size == 2 and groups.pipeline.link.bus_bandwidth_bytes_per_s == pytest.approx(20e9)


def test_data_parallel_groups_that_leave_the_node_pay_the_slower_link():
    def dp_time(gpus_per_node):
        ctx = _ctx(gpus=16, batch=16, gpus_per_node=gpus_per_node)
        problem = build_problem(ctx, _par(dp=16), ("none",))
        return evaluate(ctx, _par(dp=16), problem, problem.uniform(Split((0, 16))), True).predicted

    inside, across = dp_time(16), dp_time(8)
    assert across.time_breakdown["data_parallel_comm"] > inside.time_breakdown["data_parallel_comm"]


def test_mfu_is_model_flops_over_step_time_gpus_and_peak():
    gpu = make_gpu()
    assert mfu(1e15, 2.0, 4, gpu, "bf16") == pytest.approx(1e15 / (2.0 * 4 * 320e12))
    ctx = _ctx()
    problem = build_problem(ctx, _par(dp=8), ("none",))
    predicted = evaluate(ctx, _par(dp=8), problem, problem.uniform(Split((0, 16))), True).predicted
    assert predicted.model_flops_per_step == pytest.approx(ctx.chain.flops_per_sample * 8)
    assert predicted.mfu == pytest.approx(predicted.model_flops_per_step / (predicted.step_time_s * 8 * 320e12))
    assert predicted.tokens_per_s == pytest.approx(predicted.samples_per_s * 64)
    assert sum(predicted.time_breakdown.values()) == pytest.approx(predicted.step_time_s)


def test_unknown_dtypes_are_user_errors():
    with pytest.raises(UserError, match="fp8"):
        model_state_bytes(1, "fp8", 0, 1)
    with pytest.raises(UserError, match="no peak FLOP/s for fp16"):
        peak_flops(make_gpu(), "fp16")


def test_optimizer_pays_the_dtensor_cost_only_for_dtensor_parameters():
    base = _ctx(gpus=2, batch=8)
    gpu = replace(base.cluster.gpu, optimizer_tensor_overhead_s=1e-4, optimizer_dtensor_overhead_s=1e-2)
    hardware = replace(base.cluster.hardware, gpu=gpu)
    ctx = Context(base.profile, replace(base.cluster, hardware=hardware), base.training, base.features)

    def optimizer(par):
        problem = build_problem(ctx, par, ("none",))
        return evaluate(ctx, par, problem, problem.uniform(Split((0, len(ctx.chain)))), True).predicted.time_breakdown[
            "optimizer"]

    tensors = len(ctx.profile.parameters)
    sharded = sum(1 for p in ctx.profile.parameters if p.rpartition(".")[0] in ctx.facts.plan)
    assert 0 < sharded < tensors
    plain = optimizer(_par(dp=2, m=4))
    fsdp = optimizer(_par(dp=2, zero=3, m=4))
    tp = optimizer(_par(tp=2, m=8))
    streaming = plain - tensors * 1e-4
    # FSDP2: every parameter is a DTensor shard; TP alone: only the sharded Linears' weights and biases
    assert fsdp - streaming / 2 == pytest.approx(tensors * 1e-2, rel=1e-3)
    assert tp - tp_streaming(ctx) == pytest.approx(sharded * 1e-2 + (tensors - sharded) * 1e-4, rel=1e-3)


@pytest.mark.parametrize("implementation", ["foreach", "for-loop"])
def test_fused_adamw_streams_28_of_the_80_bytes_per_parameter_of_the_unfused_paths(implementation):
    """The plan's optimizer implementation is priced as train.py runs it: a fused step moves 7 x 4 bytes per
    parameter, the per-op paths 80 (compute.ADAMW_BYTES_PER_PARAM); per-tensor host costs are apart."""
    base = _ctx(gpus=2, batch=8)

    def optimizer(name):
        ctx = Context(base.profile, base.cluster, replace(base.training, optimizer_implementation=name),
                      base.features)
        par = _par(dp=2, m=4)
        problem = build_problem(ctx, par, ("none",))
        return evaluate(ctx, par, problem, problem.uniform(Split((0, len(ctx.chain)))), True).predicted.time_breakdown[
            "optimizer"]

    fused, unfused = optimizer("fused"), optimizer(implementation)
    assert fused > 0
    assert unfused / fused == pytest.approx(80 / 28)
    gpu = base.cluster.gpu
    assert fused == pytest.approx(base.total_numel(1) * 28 / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency))


def tp_streaming(ctx):
    """AdamW's streaming time over one tensor-parallel rank's parameters (tp = 2)."""
    from autoplan.cost.compute import optimizer_step_time

    return optimizer_step_time(ctx.total_numel(2), ctx.cluster.gpu)


def test_ddp_pays_its_measured_time_per_parameter_tensor():
    base = _ctx(gpus=2, batch=8)

    def data_parallel_comm(overhead_s, par):
        gpu = replace(base.cluster.gpu, ddp_tensor_overhead_s=overhead_s)
        cluster = replace(base.cluster, hardware=replace(base.cluster.hardware, gpu=gpu))
        ctx = Context(base.profile, cluster, base.training, base.features)
        problem = build_problem(ctx, par, ("none",))
        candidate = evaluate(ctx, par, problem, problem.uniform(Split((0, len(ctx.chain)))), True)
        return candidate.predicted.time_breakdown["data_parallel_comm"]

    ddp = _par(dp=2, m=4)
    added = data_parallel_comm(1e-3, ddp) - data_parallel_comm(0.0, ddp)
    assert added == pytest.approx(len(base.profile.parameters) * 1e-3)
    fsdp = _par(dp=2, zero=3, m=4)  # FSDP2 is not DDP: its own per-module overhead applies
    assert data_parallel_comm(1e-3, fsdp) == pytest.approx(data_parallel_comm(0.0, fsdp))


def test_plan_shows_the_activation_saving_of_sequence_parallelism_against_the_same_layout_without_it():
    profile = gpt_profile(n_layer=12, n_embd=1024, vocab=8192, seq=512, n_head=16, device="testgpu")
    training = Training(global_batch_size=16, dtype="bf16")
    on = search(profile, cluster(8), training, Layout(tp=4, pp=2, microbatch=2),
                options=SearchOptions(features=ALL_FEATURES)).best
    off = search(profile, cluster(8), training, Layout(tp=4, pp=2, microbatch=2, sp="off"),
                 options=SearchOptions(features=ALL_FEATURES)).best
    assert on.parallelism.sp and not off.parallelism.sp
    saved_with, saved_without = (on.predicted.memory_breakdown["activations"],
                                 on.predicted.activations_without_sequence_parallel_bytes)
    assert saved_with < saved_without
    same_split = [s.modules for s in on.stages] == [s.modules for s in off.stages]
    if on.activation_checkpoint_modules == off.activation_checkpoint_modules and same_split:
        assert saved_without == pytest.approx(off.predicted.memory_breakdown["activations"])
    assert off.predicted.activations_without_sequence_parallel_bytes is None


def _one_module(activation: float):
    from autoplan.cost.memory import MemoryInputs

    return MemoryInputs(module_numel=(1000.0,), group_numel=(), tied_group_modules=(), module_largest_numel=(1000.0,),
                        activations={"none": (activation,)}, working_bytes=(0.0,), cut_bytes=())


@pytest.mark.parametrize("shard, ddp", [(8, False), (1, False), (1, True)])
def test_gradients_count_from_when_the_program_makes_them(shard, ddp):
    """One micro-batch: FSDP2's sharded gradients and autograd's .grad are made during backward (set to None before
    each step), so the peak is the larger of the loss's (no gradients) and the end of backward (no activations);
    DDP's buckets hold them throughout. Under accumulation FSDP2 keeps the unsharded gradients in fp32 meanwhile."""
    from autoplan.cost.memory import MemoryLayout, layout_memory

    n = 1000.0
    fsdp = shard > 1
    states = {"parameters": 4 * n / shard, "gradients": 4 * n / shard, "optimizer": 8 * n / shard}  # fp32
    for activation in (100 * n, 0.0):  # the loss's peak dominates, then the end of backward does
        setting = MemoryLayout(shard, True, ddp=ddp, accumulates=False)
        model = layout_memory(_one_module(activation), "fp32", setting).stage(0, 1)
        peak = model.breakdown(0, 1)
        held = ddp or activation == 0.0
        assert peak.get("gradients", 0.0) == pytest.approx(states["gradients"] if held else 0.0)
        assert peak.get("activations", 0.0) == activation
    setting = MemoryLayout(shard, True, ddp=ddp, accumulates=True)
    accumulating = layout_memory(_one_module(0.0), "bf16", setting).stage(0, 1)
    assert accumulating.per_module.get("unsharded_gradients", (0.0,))[0] == (4 * n if fsdp else 0.0)
    assert ("gradients" in accumulating.per_module) == (not fsdp)  # FSDP2's sharded ones only after the last


def test_the_table_of_a_layout_is_the_table_of_what_it_reads():
    """Context.table takes the layout: its TableKey (tp, micro-batch, sp at tp > 1, loss_parallel, cp, ep) picks the
    table, the other fields (dp, pp, schedule, recompute, sharding) leave it alone, and sp at tp = 1 is no sp."""
    ctx = _ctx()
    par = Parallelism(dp_shard=2, tp=4, sp=True, pp=1, microbatch=2, microbatches=1)
    assert ctx.table(par) is ctx.table(TableKey(4, 2, sp=True))
    assert ctx.table(replace(par, dp_shard=1, dp_replicate=2, reshard=True, recompute="full")) is ctx.table(par)
    assert ctx.table(replace(par, sp=False)) is ctx.table(TableKey(4, 2)) is not ctx.table(par)
    assert ctx.table(Parallelism(sp=True, microbatch=2)) is ctx.table(TableKey(1, 2))
    assert ctx.table(replace(par, loss_parallel=False)) is ctx.table(TableKey(4, 2, sp=True, loss_parallel=False))
    assert ctx.table(par).activation_bytes != ctx.table(replace(par, sp=False)).activation_bytes
    assert ctx.memory_inputs(par) is ctx.memory_inputs(TableKey(4, 2, sp=True))
