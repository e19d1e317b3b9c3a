"""Cost model: memory against ZeRO closed forms, schedules, compute scaling, collectives, MFU."""

from dataclasses import replace

import pytest
from chain_fixtures import LAUNCH_S, cluster, gpt_profile, make_gpu

from autoplan.cost import comm
from autoplan.cost.compute import mfu, unit_times
from autoplan.cost.dtypes import activation_scale, peak_flops
from autoplan.cost.memory import model_state_bytes, stage_memory_model
from autoplan.cost.pipeline import bubble_fraction, microbatches_in_flight, pipeline_time
from autoplan.errors import UserError
from autoplan.hardware.types import Link
from autoplan.plan import Parallelism, Training
from autoplan.solve.evaluate import build_problem, evaluate_split
from autoplan.solve.layers import build_chain
from autoplan.solve.problem import Split

PSI = 1_000_000


def _par(dp=1, pp=1, zero=0, schedule="1f1b", mbs=1, m=1):
    return Parallelism(data_parallel_replicate_degree=dp if zero == 0 else 1,
                       data_parallel_shard_degree=dp if zero == 3 else 1, pipeline_parallel_degree=pp,
                       pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=mbs,
                       pipeline_parallel_num_microbatches=m, zero_stage=zero)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_states_match_the_zero_closed_forms(dtype):
    nd, k = 8, 12  # ZeRO paper: mixed-precision Adam keeps K = 12 bytes of optimizer state
    assert sum(model_state_bytes(PSI, dtype, 0, nd).values()) == 16 * PSI
    assert sum(model_state_bytes(PSI, dtype, 3, nd).values()) == pytest.approx(16 * PSI / nd)
    if dtype == "bf16":
        assert sum(model_state_bytes(PSI, dtype, 1, nd).values()) == pytest.approx(4 * PSI + k * PSI / nd)
        assert sum(model_state_bytes(PSI, dtype, 2, nd).values()) == pytest.approx(2 * PSI + (2 + k) * PSI / nd)


def test_stage_memory_of_a_whole_model_is_16_psi_replicated_and_16_psi_over_nd_with_fsdp():
    chain = build_chain(gpt_profile(n_layer=12))
    psi = chain.parameter_numel
    states = ("parameters", "gradients", "optimizer")
    ddp = stage_memory_model(chain, _par(dp=8), "bf16", 0).breakdown(0, len(chain))
    assert sum(ddp[c] for c in states) == pytest.approx(16 * psi)
    fsdp = stage_memory_model(chain, _par(dp=8, zero=3), "bf16", 0).breakdown(0, len(chain))
    assert sum(fsdp[c] for c in states) == pytest.approx(16 * psi / 8)
    largest_unit = max(u.parameter_numel for u in chain.units)
    assert fsdp["gathered_parameters"] == pytest.approx(2 * largest_unit)  # one bf16 unit in flight


def test_fsdp_under_a_pipeline_holds_the_stage_unsharded():
    chain = build_chain(gpt_profile(n_layer=12))
    model = stage_memory_model(chain, _par(dp=4, pp=2, zero=3, m=4), "fp32", 0)
    part = model.breakdown(2, 8)
    numel = sum(u.parameter_numel for u in chain.units[2:8])
    assert part["gathered_parameters"] == part["unsharded_gradients"] == pytest.approx(4 * numel)
    assert part["optimizer"] == pytest.approx(8 * numel / 4)


def test_tied_parameters_are_held_once_per_stage_that_uses_them():
    chain = build_chain(gpt_profile(n_layer=12))
    tied = chain.tied_groups[0].numel
    model = stage_memory_model(chain, _par(), "fp32", 0)
    whole = model.breakdown(0, len(chain))["parameters"]
    first, last = model.breakdown(0, 2)["parameters"], model.breakdown(len(chain) - 1, len(chain))["parameters"]
    assert whole == pytest.approx(4 * chain.parameter_numel)
    assert first + last == pytest.approx(4 * (chain.units[0].parameter_numel + chain.units[1].parameter_numel + tied))


def test_in_flight_micro_batches_per_schedule():
    assert [microbatches_in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    assert [microbatches_in_flight("gpipe", 4, 8, s) for s in range(4)] == [8, 8, 8, 8]
    assert microbatches_in_flight("gpipe", 1, 8, 0) == 1  # gradient accumulation


def test_activation_memory_scales_with_schedule_micro_batch_size_and_dtype():
    chain = build_chain(gpt_profile(n_layer=12))
    saved = sum(u.saved_bytes for u in chain.units[2:6])

    def acts(par, dtype="fp32", stage=0):
        model = stage_memory_model(chain, par, dtype, stage)
        return sum(model.per_unit["activations"][2:6])

    assert acts(_par(pp=4, schedule="gpipe", mbs=2, m=8)) == pytest.approx(saved * 2 * 8)
    assert acts(_par(pp=4, mbs=2, m=8), stage=1) == pytest.approx(saved * 2 * 3)
    assert acts(_par(pp=4, mbs=2, m=8), "bf16", 1) == pytest.approx(saved * 2 * 3 / 2)
    assert activation_scale("float32", "bf16") == 0.5


def test_bubble_is_p_minus_1_over_m_of_the_ideal_time():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    timing = pipeline_time(slot_s=2.0, num_stages=4, num_microbatches=8)
    assert timing.bubble_s / timing.busy_s == pytest.approx(3 / 8) and timing.total_s == pytest.approx(22.0)


def test_priced_pipeline_has_the_textbook_bubble_when_communication_is_free():
    chain = build_chain(gpt_profile(n_layer=12))
    free = cluster(4, intra_bw=1e30, inter_bw=1e30, latency_s=0.0)
    training = Training(global_batch_size=8)
    par = _par(dp=1, pp=4, mbs=1, m=8)
    problem = build_problem(chain, free, training, par)
    candidate = evaluate_split(chain, free, training, par, problem, Split((0, 5, 8, 11, 16)), True)
    times = candidate.predicted.time_breakdown
    assert times["bubble"] / times["compute"] == pytest.approx(3 / 8)
    assert times["pipeline_comm"] == pytest.approx(0.0, abs=1e-12)
    slowest = max(s.predicted_time_s for s in candidate.stages)
    assert candidate.predicted.step_time_s == pytest.approx((8 + 4 - 1) * slowest + times["optimizer"])


def test_unit_times_keep_launch_overheads_fixed_and_scale_the_rest_linearly():
    chain = build_chain(gpt_profile(n_layer=12, batch=4))
    gpu = make_gpu()
    one, two = unit_times(chain, gpu, "fp32", 1), unit_times(chain, gpu, "fp32", 2)
    block = chain.units[2]
    fixed = block.op_count * LAUNCH_S
    assert two.fwd[2] - fixed == pytest.approx(2 * (one.fwd[2] - fixed))
    four = unit_times(chain, gpu, "fp32", 4)
    assert four.fwd[2] == pytest.approx(block.time_fwd_s * 4)  # the profiled batch: as measured
    no_launch = replace(gpu, kernel_overhead_s=0.0)
    doubled = unit_times(chain, no_launch, "fp32", 2).bwd[2]
    assert doubled == pytest.approx(2 * unit_times(chain, no_launch, "fp32", 1).bwd[2])


def test_bf16_speeds_up_a_roofline_profile_but_not_a_cpu_measurement():
    gpu = make_gpu()
    cpu_chain = build_chain(gpt_profile(n_layer=12))
    assert unit_times(cpu_chain, gpu, "bf16", 1) == unit_times(cpu_chain, gpu, "fp32", 1)
    gpu_chain = build_chain(gpt_profile(n_layer=12, device="testgpu"))
    fp32, bf16 = unit_times(gpu_chain, gpu, "fp32", 1).total, unit_times(gpu_chain, gpu, "bf16", 1).total
    assert all(b < f for b, f in zip(bf16, fp32))
    assert sum(bf16) > sum(fp32) * peak_flops(gpu, "fp32") / peak_flops(gpu, "bf16")  # memory-bound share


def test_collectives_follow_the_alpha_beta_bus_factors():
    link = Link("l", 100e9, 1e-5, "test")
    nbytes = 1e9
    assert comm.all_reduce_s(nbytes, 8, link) == pytest.approx(1e-5 + 2 * 7 / 8 * nbytes / 100e9)
    assert comm.all_gather_s(nbytes, 4, link) == pytest.approx(1e-5 + 3 / 4 * nbytes / 100e9)
    assert comm.all_reduce_s(nbytes, 1, link) == 0.0
    assert comm.p2p_s(nbytes, link) == pytest.approx(1e-5 + nbytes / 100e9)
    assert comm.exposed_s(total_s=10, serial_s=1, window_s=4) == 6
    assert comm.exposed_s(total_s=10, serial_s=1, window_s=20) == 1


def test_ddp_overlaps_everything_but_the_last_bucket():
    link = Link("l", 100e9, 0.0, "test")
    grads = 40 * comm.DDP_BUCKET_BYTES
    hidden = comm.ddp_comm(grads, 8, link, backward_window_s=1e3)
    assert hidden.per_step_s == pytest.approx(comm.all_reduce_s(comm.DDP_BUCKET_BYTES, 8, link))
    exposed = comm.ddp_comm(grads, 8, link, backward_window_s=0.0)
    assert exposed.per_step_s == pytest.approx(comm.all_reduce_s(grads, 8, link))
    assert comm.ddp_comm(grads, 1, link, 0.0).per_step_s == 0.0


def test_data_parallel_groups_that_leave_the_node_pay_the_slower_link():
    chain = build_chain(gpt_profile(n_layer=12))
    training = Training(global_batch_size=16)
    par = _par(dp=16, m=1)

    def dp_time(gpus_per_node):
        big = cluster(16, gpus_per_node=gpus_per_node)
        problem = build_problem(chain, big, training, par)
        return evaluate_split(chain, big, training, par, problem, Split((0, len(chain))), True)

    inside, across = dp_time(16), dp_time(8)
    assert across.predicted.time_breakdown["data_parallel_comm"] > inside.predicted.time_breakdown["data_parallel_comm"]


def test_mfu_is_model_flops_over_step_time_gpus_and_peak():
    gpu = make_gpu()
    assert mfu(1e15, 2.0, 4, gpu, "bf16") == pytest.approx(1e15 / (2.0 * 4 * 320e12))
    chain = build_chain(gpt_profile(n_layer=12))
    training = Training(global_batch_size=8, dtype="bf16")
    c = cluster(8)
    problem = build_problem(chain, c, training, _par(dp=8))
    predicted = evaluate_split(chain, c, training, _par(dp=8), problem, Split((0, len(chain))), True).predicted
    assert predicted.model_flops_per_step == pytest.approx(chain.flops_per_sample * 8)
    assert predicted.mfu == pytest.approx(predicted.model_flops_per_step / (predicted.step_time_s * 8 * 320e12))
    assert predicted.tokens_per_s == pytest.approx(predicted.samples_per_s * 64)


def test_unknown_dtypes_are_user_errors():
    with pytest.raises(UserError, match="fp8"):
        model_state_bytes(1, "fp8", 0, 1)
    with pytest.raises(UserError, match="no peak FLOP/s for fp16"):
        peak_flops(make_gpu(), "fp16")
