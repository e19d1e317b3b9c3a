"""Pricing of CPU offload (FSDP2 CPUOffloadPolicy) and torch.compile, and the search's choices of both
(no processes: the offload run itself needs a GPU, tests/test_compile_offload.py runs its CPU code path)."""

import json
from dataclasses import replace

import pytest
from chain_fixtures import GIB, cluster, gpt_profile

from autoplan.cost.context import TableKey
from autoplan.cost import calibration, comm
from autoplan.cost.compute import ADAMW_BYTES_PER_PARAM
from autoplan.cost.context import Context
from autoplan.cost.evaluate import build_problem, evaluate
from autoplan.cost.memory import HOST_STATE_BYTES_PER_PARAM, OFFLOAD_STAGING_BYTES_PER_PARAM
from autoplan.cost.problem import Split
from autoplan.errors import Infeasible, UserError
from autoplan.hardware.types import Host
from autoplan.layout import SUPPORTED, problems
from autoplan.plan import Compile, Parallelism, Plan, Training
from autoplan.solve.layouts import scope_of
from autoplan.solve.pins import parse_pins
from autoplan.solve.search import search

TRAINING = Training(global_batch_size=16, dtype="bf16")
HOST = Host(memory_bytes=512 * GIB, memory_bandwidth_bytes_per_s=100e9, memory_efficiency=0.5,
            link_bandwidth_bytes_per_s=20e9, source="test")


def with_host(c, host=HOST):
    return replace(c, hardware=replace(c.hardware, host=host))


def fsdp(offload: bool, m: int = 2) -> Parallelism:
    return Parallelism(dp_shard=8, reshard=True,
                       microbatch=16 // 8 // m, microbatches=m,
                       offload=offload)


def priced(ctx, par):
    problem = build_problem(ctx, par, ("none",))
    return evaluate(ctx, par, problem, problem.uniform(Split((0, len(ctx.chain)))), True)


@pytest.fixture(scope="module")
def ctx():
    return Context(gpt_profile(n_layer=4), with_host(cluster(8)), TRAINING, SUPPORTED)


def test_offload_moves_the_model_states_to_the_host_and_stages_a_shard_per_unit(ctx):
    on, off = priced(ctx, fsdp(True)).predicted, priced(ctx, fsdp(False)).predicted
    for category in ("parameters", "optimizer"):
        assert off.memory_breakdown[category] > 0 and on.memory_breakdown[category] == 0
    assert on.memory_breakdown.get("gradients", 0.0) == 0  # off: made in backward, none at the loss's peak
    assert on.memory_breakdown["gathered_parameters"] == off.memory_breakdown["gathered_parameters"]
    largest = max(ctx.memory_inputs(TableKey(1, 1)).module_largest_numel)  # the unit whose shards are staged
    assert on.memory_breakdown["offload_staging"] == pytest.approx(
        calibration.FSDP_PREFETCH_UNITS * largest * OFFLOAD_STAGING_BYTES_PER_PARAM / 8)
    assert on.peak_memory_bytes < off.peak_memory_bytes
    # every rank of the node keeps its 1/8 of the states there: 16 bytes per parameter in all
    assert on.host_memory_per_node_bytes == pytest.approx(HOST_STATE_BYTES_PER_PARAM * ctx.total_numel(1))
    assert off.host_memory_per_node_bytes == 0


def test_offload_steps_adamw_on_the_host_memory_the_node_shares(ctx):
    on = priced(ctx, fsdp(True)).predicted.time_breakdown["optimizer"]
    tensors = len(ctx.profile.parameters)
    per_rank_bandwidth = HOST.memory_bandwidth_bytes_per_s * HOST.memory_efficiency / 8
    streaming = ctx.total_numel(1) / 8 * ADAMW_BYTES_PER_PARAM["fused"] / per_rank_bandwidth
    assert on == pytest.approx(streaming + tensors * calibration.HOST_ADAMW_TENSOR_OVERHEAD_S)


def test_offload_adds_each_units_shard_crossing_the_host_link_per_gather_and_reduction():
    group = comm.Group(8, comm_link(), 1)
    common = dict(module_param_bytes=(4e6, 8e6), reshards_after_forward=True, shard=group, replicate=comm.Group(1, comm_link(), 1),
                  pipelined=False, microbatches=3, forward_window_s=0.0, backward_window_s=0.0,
                  copy_bytes_per_s=1e12, gradient_ratio=2.0)
    plain = comm.fsdp_comm(comm.FsdpStage(**common))
    offloaded = comm.fsdp_comm(comm.FsdpStage(**common, host_link_bytes_per_s=1e9))
    shards_in = sum(b * 2.0 / 8 for b in (4e6, 8e6)) / 1e9  # fp32 shards, before each gather
    grads_out = sum(b * 2.0 / 8 for b in (4e6, 8e6)) / 1e9  # fp32 reduced gradient shards, after each reduction
    # per micro-batch: gathered for forward and again for backward, reduced once
    assert offloaded.total_s - plain.total_s == pytest.approx(3 * (2 * shards_in + grads_out))
    # with nothing to hide behind, every copy is exposed
    assert offloaded.per_microbatch_s - plain.per_microbatch_s == pytest.approx(2 * shards_in + grads_out)


def comm_link():
    from autoplan.hardware.types import Link

    return Link("test", 100e9, 1e-5, "test")


def test_compile_scales_pointwise_ops_by_their_factor_and_leaves_matmuls(ctx):
    eager, compiled = ctx.table(TableKey(1, 2)), ctx.compiled_as(True).table(TableKey(1, 2))
    factor = calibration.COMPILE_TIME_FACTOR["pointwise"]
    assert 0 < factor < 1 and calibration.COMPILE_TIME_FACTOR["gemm"] == calibration.COMPILE_TIME_FACTOR["attention"] == 1
    fusing = [any(op.compile_class == "pointwise" for op in m.ops) for m in ctx.costs.modules]
    assert any(fusing) and not all(fusing)  # the blocks have pointwise ops; the embeddings do not
    for u, fuses in enumerate(fusing):
        for compiled_s, eager_s in ((compiled.forward_s[u], eager.forward_s[u]), (compiled.backward_s[u], eager.backward_s[u])):
            assert compiled_s < eager_s if fuses else compiled_s == eager_s
    # the module table's cache is keyed by it: the eager one is not overwritten
    assert ctx.table(TableKey(1, 2)) is eager and not ctx.compiled


def test_the_search_offloads_only_when_nothing_else_fits():
    profile = gpt_profile(n_layer=8, n_embd=512, vocab=4096, seq=128)
    ample = search(profile, with_host(cluster(8)), TRAINING)
    assert not ample.best.parallelism.offload
    offloaded = [c for c in ample.candidates if c.parallelism.offload]
    assert offloaded and all("CPU offload" in c.reason or not c.fits for c in offloaded)
    states = 16 * sum(profile.parameters.values()) / 8  # FSDP's model states per GPU
    tight = with_host(replace(cluster(8), memory_per_gpu_bytes=0.6 * states))
    best = search(profile, tight, TRAINING).best
    assert best.parallelism.offload and best.fits
    assert best.predicted.time_breakdown["optimizer"] > ample.best.predicted.time_breakdown["optimizer"]
    small_host = replace(tight, host_memory_per_node_bytes=0.5 * 16 * sum(profile.parameters.values()))
    with pytest.raises(Infeasible, match=r"; CPU offload needs [\d.]+ GiB of host memory per node, has [\d.]+ GiB"):
        search(profile, small_host, TRAINING)
    no_link = with_host(tight, replace(HOST, link_bandwidth_bytes_per_s=0.0))
    with pytest.raises(Infeasible):
        search(profile, no_link, TRAINING)


def test_compile_is_on_for_gpus_off_for_cpu_processes_and_the_other_choice_is_listed():
    profile = gpt_profile(n_layer=2)
    result = search(profile, cluster(8), TRAINING)
    assert result.best.compile
    twin = [c for c in result.candidates if not c.compile and c.parallelism == result.best.parallelism]
    assert len(twin) == 1
    # any other layout listed uncompiled is one the rules refuse compiled (search.runnable)
    scope = scope_of(result.context)
    assert all(problems(replace(c.parallelism.layout(), compile="on"), scope)
               for c in result.candidates if not c.compile and c is not twin[0])
    assert twin[0].predicted.step_time_s > result.best.predicted.step_time_s
    assert twin[0].reason.startswith("compile=off: ") and "slower than compile=on" in twin[0].reason
    pinned = search(profile, cluster(8), TRAINING, parse_pins("compile=off"))
    assert not pinned.best.compile and pinned.best.predicted.step_time_s == pytest.approx(twin[0].predicted.step_time_s)
    cpu = replace(cluster(8), hardware=replace(cluster(8).hardware, gpu=replace(cluster(8).gpu, name="cpu")))
    on_cpu = search(profile, cpu, TRAINING)
    assert not on_cpu.best.compile
    assert any(c.compile and "off by default for CPU processes" in c.reason for c in on_cpu.candidates)


@pytest.mark.parametrize("pin, message", [
    ("offload=cpu,zero=0", "offload=cpu needs FSDP"),
    ("offload=cpu,pp=2", "offload=cpu with pp=2"),
    ("offload=gpu", "offload=gpu is not one of none, cpu"),
    ("compile=yes", "compile=yes is not one of off, on"),
])
def test_offload_and_compile_pins_that_cannot_hold_say_why(pin, message):
    with pytest.raises(UserError, match=message):
        search(gpt_profile(n_layer=2), with_host(cluster(8)), TRAINING, parse_pins(pin))


def test_a_pinned_offload_on_cpu_processes_is_refused():
    cpu_host = replace(HOST, link_bandwidth_bytes_per_s=0.0)
    with pytest.raises(UserError, match="host-device link"):
        search(gpt_profile(n_layer=2), with_host(cluster(8), cpu_host), TRAINING, parse_pins("offload=cpu,zero=3"))


def test_plan_json_carries_offload_compile_and_host_memory():
    profile = gpt_profile(n_layer=2)
    best = search(profile, with_host(cluster(8)), TRAINING, parse_pins("offload=cpu,zero=3,compile=on")).best
    from autoplan.plan import ClusterRef, ModelRef, SolverInfo

    plan = Plan(model=ModelRef("m.py"), cluster=ClusterRef("testgpu", 8, 8, 80 * GIB), training=TRAINING,
                parallelism=best.parallelism, stages=best.stages, predicted=best.predicted,
                solver=SolverInfo("highs", "optimal", 0.0, 1), compile=Compile(enable=best.compile))
    raw = json.loads(plan.to_json())
    assert raw["parallelism"]["enable_cpu_offload"] is True and raw["compile"] == {"enable": True}
    assert raw["predicted"]["host_memory_per_node_bytes"] > 0
    again = Plan.from_json(plan.to_json())
    assert again == plan
    del raw["compile"]
    assert Plan.from_dict(raw).compile == Compile(enable=False)  # optional in schema 2


def test_host_memory_per_node_overrides_the_profile_and_bad_values_say_which_option():
    from autoplan.api import load_cluster

    cluster = load_cluster(8, "h100-sxm5-80gb", None, None, None, "1TiB")
    assert cluster.host_memory_bytes == 2**40
    assert load_cluster(8, "h100-sxm5-80gb", None, None, None).host_memory_bytes == 2048 * GIB  # DGX H100
    with pytest.raises(UserError, match="--host-memory-per-node: cannot read memory size 'lots'"):
        load_cluster(8, "h100-sxm5-80gb", None, None, None, "lots")


def test_a_70b_model_on_8_h100s_fits_only_with_cpu_offload():
    """A GPT of Llama-3-70B's size (80 layers, hidden 8192, vocabulary 128256; 4h MLP: 65e9 parameters): no
    layout fits 8 H100 80GB without offload (FSDP's 16 bytes per parameter over 8 GPUs alone are 121 GiB per
    GPU); with it, FSDP over the 8 GPUs plans within the DGX H100's 2 TiB of host memory per node."""
    from autoplan.hardware.profiles import load_hardware
    from autoplan.hardware.types import Cluster

    profile = gpt_profile(n_layer=80, n_embd=8192, vocab=128256, seq=2048, n_head=64, tied=False)
    h100 = Cluster(load_hardware("h100-sxm5-80gb"), 8, 8)
    result = search(profile, h100, Training(global_batch_size=16, dtype="bf16"))
    best = result.best
    assert best.fits and best.parallelism.offload and best.parallelism.dp_shard == 8
    assert best.predicted.peak_memory_bytes <= h100.usable_memory_bytes
    host = best.predicted.host_memory_per_node_bytes
    assert host == pytest.approx(16 * sum(profile.parameters.values())) and host <= h100.host_memory_bytes
    assert all(not c.fits for c in result.candidates if not c.parallelism.offload)
    assert best.predicted.time_breakdown["optimizer"] > 1.0  # 65e9 x 28 B / 8 ranks through shared host memory


def test_why_the_other_compile_choice_lost_reads_the_default_the_pin_and_the_rules():
    """One reason per case (search._why_compile_lost): compiled winner; compiled by default but refused by a rule
    (search.runnable); pinned off; off by default for CPU processes; a rule refusing the compiled twin of an
    uncompiled winner is named after any OOM clause, as the reason's ending."""
    from autoplan.solve.search import _why_compile_lost

    rule = "schedule=zbv splits backward"
    assert _why_compile_lost(True, 3.25, True, False, []) == (
        "compile=off: 3.2% slower than compile=on (pointwise ops run unfused)", "")
    assert _why_compile_lost(False, -4.0, True, False, [rule]) == (
        "compile=on: 4.0% faster per step, but the program cannot run it", f": {rule}")
    assert _why_compile_lost(False, -4.0, False, True, []) == ("compile=on: 4.0% faster, but pinned off", "")
    assert _why_compile_lost(False, -4.0, False, True, [rule]) == (
        "compile=on: 4.0% faster, but pinned off", f"; and the program cannot run it: {rule}")
    opening, ending = _why_compile_lost(False, -4.0, False, False, [])
    assert opening.startswith("compile=on: 4.0% faster per step, but off by default for CPU processes") and not ending
    pinned = search(gpt_profile(n_layer=2), cluster(8), TRAINING, parse_pins("compile=off"))
    twin = [c for c in pinned.candidates if c.compile and c.parallelism == pinned.best.parallelism]
    assert len(twin) == 1 and twin[0].reason.startswith("compile=on: ") and "faster, but pinned off" in twin[0].reason
