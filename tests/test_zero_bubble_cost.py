"""Zero-bubble pipeline schedules in the plan vocabulary and the cost model: the operation orders the cost model
simulates are torch's own (each class's _calculate_single_rank_operations), the layout rules, and the closed-form
checks of Qi et al. (shared/reference/formulas.md) on stages with equal forward, input-gradient and weight-gradient
passes."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from autoplan.cost.pipeline import (StageCost, microbatches_in_flight, simulate, simulated_step_s, split_backward_order,
                                   swept_makespan_s)
from autoplan.layout import (SCHEDULE_BY_NAME, SCHEDULES, ZERO_BUBBLE_SCHEDULES, Layout, Scope, problems, rank_stages,
                             stage_rank)

KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def torch_order(schedule: str, p: int, m: int, rank: int, v: int) -> list[tuple[str, int, int]]:
    """The rank's compute actions as torch's schedule class plans them (no process group: the planning method
    reads only these attributes), as (kind, local chunk, micro-batch); DualPipeV's overlapped pairs in order."""
    if schedule == "zb-interleaved":
        rounds = max(1, m // p)
        fake = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p, _n_microbatches=m)
        actions = torch_schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, rank)
    elif schedule == "zbv":
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        actions = torch_schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank)
    else:
        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
        actions = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, rank)
    local = rank_stages(rank, p, v, SCHEDULE_BY_NAME[schedule].placement)
    return [(KINDS[b.computation_type.name], local.index(b.stage_index), b.microbatch_index)
            for a in actions if a is not None for b in (a.sub_actions or (a,))]


CASES = [("zb-interleaved", p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)] + \
    [(s, p, 2, m) for s in ("zbv", "dualpipev") for p in (2, 3, 4) for m in (2 * p, 2 * p + 1, 3 * p)] + \
    [("zbv", p, 2, m) for p in (2, 4) for m in (1, p)]


@pytest.mark.parametrize("schedule, p, v, m", CASES)
def test_operation_order_is_torchs(schedule, p, v, m):
    for rank in range(p):
        assert split_backward_order(schedule, p, m, rank, v) == torch_order(schedule, p, m, rank, v)


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    assert [stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages(1, 4, 2, "v") == [1, 6] and rank_stages(1, 4, 2, "loop") == [1, 5]
    # torch's own mapping for its V schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    assert generate_stage_to_rank_mapping(4, 8, style="v") == {s: stage_rank(s, 4, "v") for s in range(8)}


def _equal_passes(schedule: str, p: int, m: int, v: int):
    """Stages of one pass unit each of forward, input gradient and weight gradient per micro-batch, split over the
    rank's v stages; no transfers."""
    stages = [StageCost(forward_s=1 / v, backward_s=2 / v, weight_s=1 / v) for _ in range(p * v)]
    return simulate(schedule, p, m, stages)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_matches_the_published_formulas_with_equal_passes(p):
    m = 3 * p
    busy = 3.0 * m  # every rank: m x (F + B + W)
    # 1F1B: (p - 1)(T_F + T_B + T_W); ZB-H1 (torch's InterleavedZeroBubble on one stage per rank, ZB-1P):
    # (p - 1)(T_F + T_B - T_W) (Qi et al. 2023, shared/reference/formulas.md)
    assert _equal_passes("1f1b", p, m, 1).makespan_s - busy == pytest.approx((p - 1) * 3.0)
    assert _equal_passes("zb-interleaved", p, m, 1).makespan_s - busy == pytest.approx((p - 1) * (1 + 1 - 1))
    # the V-shaped and interleaved ones halve the stage: the fill is (p - 1) forwards of half a stage
    for schedule in ("zb-interleaved", "zbv", "dualpipev"):
        assert _equal_passes(schedule, p, m, 2).makespan_s - busy == pytest.approx((p - 1) * 0.5)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_peak_micro_batches_in_flight_match_the_published_counts(p):
    m = 3 * p
    # 1F1B keeps p micro-batches on the first stage; ZB-H1 keeps 1F1B's p on every rank (Qi et al. section 2.1);
    # ZB-V keeps p whole-stage micro-batches: 2p of each half-size chunk (Qi et al. section 6)
    assert microbatches_in_flight("1f1b", p, m, 0) == p
    for stage in range(p):
        assert microbatches_in_flight("zb-interleaved", p, m, stage, 1) == p
    for rank in range(p):
        held = [microbatches_in_flight("zbv", p, m, s, 2) for s in rank_stages(rank, p, 2, "v")]
        assert sum(held) == 2 * p


def test_weight_gradient_passes_keep_activations_longer_than_1f1b():
    """ZB-H1 runs each W after later forwards: the last rank keeps p micro-batches where 1F1B keeps 1."""
    p, m = 4, 12
    assert microbatches_in_flight("1f1b", p, m, p - 1) == 1
    assert microbatches_in_flight("zb-interleaved", p, m, p - 1, 1) == p


def test_vocabulary_has_one_name_per_schedule_and_torch_runs_each():
    from torch.distributed import pipelining
    assert ZERO_BUBBLE_SCHEDULES == ("zb-interleaved", "zbv", "dualpipev")
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved", *ZERO_BUBBLE_SCHEDULES}
    for name in SCHEDULES:
        facts = SCHEDULE_BY_NAME[name]
        assert getattr(pipelining, facts.torch_class).__name__ == facts.torch_class
        assert torch_schedules.get_schedule_class(facts.torchtitan_name).__name__ == facts.torch_class


@pytest.mark.parametrize("layout, expected", [
    (Layout(pp=2, schedule="zbv", virtual_stages=3), "runs 2 stages per pipeline rank, but virtual_stages=3"),
    (Layout(pp=2, schedule="dualpipev", virtual_stages=2, microbatches=3), "at least pp x virtual_stages = 4"),
    (Layout(pp=2, schedule="zb-interleaved", virtual_stages=2, microbatches=3), "a multiple of pp=2"),
    (Layout(pp=2, schedule="zbv", virtual_stages=2, compile="on"), "refuses for compiled stages"),
    (Layout(pp=2, schedule="1f1b", virtual_stages=2), "virtual stages need schedule=interleaved"),
    (Layout(pp=2, schedule="dualpipev", virtual_stages=2, recompute="selective"), "with recompute=selective"),
])
def test_rules_refuse_what_torch_cannot_run(layout, expected):
    assert any(expected in text for text in problems(layout, Scope())), problems(layout, Scope())


def test_rules_accept_the_runnable_ones():
    for layout in (Layout(pp=2, dp=1, schedule="zbv", virtual_stages=2, microbatches=1),
                   Layout(pp=2, dp=1, schedule="dualpipev", virtual_stages=2, microbatches=4),
                   Layout(pp=2, dp=1, schedule="zb-interleaved", virtual_stages=1, microbatches=2),
                   Layout(pp=2, dp=2, dp_replicate=2, dp_shard=1, schedule="zbv", virtual_stages=2, microbatches=4),
                   Layout(pp=2, dp=2, dp_replicate=1, dp_shard=2, reshard="always", schedule="dualpipev",
                          virtual_stages=2, microbatches=4),
                   Layout(pp=2, cp=2, reshard="always", schedule="zb-interleaved", virtual_stages=2, microbatches=4)):
        assert problems(layout, Scope()) == []


def test_the_predicted_timeline_draws_forward_input_and_weight_gradient_passes():
    """trace.json and the report's chart (report/schedule.step_schedule) of a zbv plan: F, B (input gradients) and W
    blocks on both ranks, the V's transfers between the ranks that hold neighbouring stages."""
    from dataclasses import replace

    from autoplan.report.schedule import step_schedule
    from helpers.plans import pinned_plan

    plan = pinned_plan("model.py", [("a",), ("b",), ("c",), ("d",)], pp=2,
                       schedule="zbv", virtual_stages=2,
                       microbatches=4, microbatch=2)
    plan = replace(plan, stages=tuple(replace(s, predicted_forward_s=0.01, predicted_time_s=0.03,
                                              predicted_weight_s=0.01, predicted_send_s=0.001) for s in plan.stages))
    events = step_schedule(plan)
    labels = {(e.rank, e.label[0]) for e in events if e.lane == "compute" and e.label[0] in "FBW"}
    assert labels == {(r, k) for r in (0, 1) for k in "FBW"}
    weight = [e for e in events if e.kind == "weight_gradient"]
    assert len(weight) == 4 * 4 and all(abs(e.duration_s - 0.01) < 1e-12 for e in weight)
    sends = {(e.stage, e.peer) for e in events if e.kind == "send" and e.payload == "activation"}
    assert sends == {(0, 1), (2, 0)}  # stage 1 -> 2 stays on rank 1 (no transfer); stage 2 -> 3 goes back to rank 0


ALL_SHAPES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-interleaved", 1), ("zb-interleaved", 2), ("zbv", 2),
              ("dualpipev", 2)]


def _uneven(p: int, v: int, send_s: float, seed: int) -> list[StageCost]:
    """Stages of uneven forward, backward and weight-gradient times (the last one heavier, as a loss head is)."""
    import random

    rng = random.Random(seed)
    return [StageCost(rng.uniform(0.5, 1.5) + (1.0 if s == p * v - 1 else 0.0), rng.uniform(1.0, 3.0),
                      send_s if s < p * v - 1 else 0.0, weight_s=rng.uniform(0.2, 0.9)) for s in range(p * v)]


@pytest.mark.parametrize("schedule, v", ALL_SHAPES)
def test_the_swept_timeline_is_the_simulated_one(schedule, v):
    """swept_makespan_s (deep pipelines) runs the same orders as simulate: the same makespan without transfers, and
    within 2% with transfers of a tenth of a forward (it does not queue them on the send and receive streams)."""
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p):
            for seed, send in enumerate((0.0, 0.1)):
                stages = _uneven(p, v, send, seed)
                exact = simulate(schedule, p, m, stages).makespan_s
                assert swept_makespan_s(schedule, p, m, stages) == pytest.approx(exact, rel=1e-9 if not send else 0.02)


@pytest.mark.parametrize("schedule, v", ALL_SHAPES)
def test_deep_pipelines_are_extrapolated_from_six_rounds(schedule, v):
    """Past six rounds of p micro-batches every round adds the same time: the extrapolation of a 16-deep pipeline
    over 16 rounds is its whole swept timeline (within 1%: rendezvous receives can keep an interleaved schedule
    from settling, 0.4% off here for one of the two stage draws)."""
    p, m = 16, 256
    for seed in (7, 8):
        stages = _uneven(p, v, 0.02, seed)
        swept = swept_makespan_s(schedule, p, m, stages)
        assert simulated_step_s(schedule, p, m, stages) == pytest.approx(swept, rel=0.01 if schedule == "interleaved"
                                                                         else 1e-9)


def test_deep_pipelines_get_the_zero_bubble_credit():
    """64 ranks (the depth the search plans for the largest models) are priced from the schedules' own orders: the
    bubbles of the published formulas (the closed form that priced them before gave zero-bubble schedules 1F1B's)."""
    p, m = 64, 128
    busy = 3.0 * m
    assert _equal_passes_step("1f1b", p, m, 1) - busy == pytest.approx((p - 1) * 3.0)
    assert _equal_passes_step("zb-interleaved", p, m, 1) - busy == pytest.approx((p - 1) * (1 + 1 - 1))
    for schedule in ("zbv", "dualpipev"):
        assert _equal_passes_step(schedule, p, m, 2) - busy == pytest.approx((p - 1) * 0.5)


def _equal_passes_step(schedule: str, p: int, m: int, v: int) -> float:
    stages = [StageCost(forward_s=1 / v, backward_s=2 / v, weight_s=1 / v) for _ in range(p * v)]
    return simulated_step_s(schedule, p, m, stages)


def test_the_accuracy_section_prices_one_published_run():
    """benchmarks/accuracy.py --zero-bubble on Qi et al.'s first run (1.5B on 8 A100s, 24 micro-batches of 6), priced
    with the GPT profile generator instead of a capture: the published speed-ups are the table's ratios, the
    predicted ones the step-time ratios, and the zero-bubble schedules beat 1F1B (their bubble credit)."""
    import csv
    import sys
    from pathlib import Path

    from chain_fixtures import a100_cluster, gpt_profile

    from autoplan.plan import Training
    from autoplan.solve.search import search

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import accuracy

    with open(root / "benchmarks" / "zero_bubble_runs.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert (row["model"], row["gpus"], row["microbatches"]) == ("1.5B", "8", "24")
    profile = gpt_profile(n_layer=int(row["layers"]), n_embd=int(row["hidden"]), vocab=accuracy.ZERO_BUBBLE_VOCAB,
                          seq=int(row["seq_len"]), batch=int(row["microbatch_size"]), n_head=int(row["heads"]),
                          device=row["gpu"], attention="megatron")
    priced: dict[str, float] = {}

    def price(row: dict, schedule: str, uncapped: bool) -> dict:
        v = 2 if schedule in ("zbv", "dualpipev") else 1
        pins = Layout(tp=1, sp="off", pp=int(row["gpus"]), dp=1, zero=0, recompute="none", schedule=schedule,
                      compile="off", microbatch=int(row["microbatch_size"]), virtual_stages=v)
        batch = int(row["microbatch_size"]) * int(row["microbatches"])
        best = search(profile, a100_cluster(int(row["gpus"])), Training(global_batch_size=batch, dtype="bf16"),
                      pins).best
        priced[schedule] = best.predicted.step_time_s
        return {"step": best.predicted.step_time_s, "virtual": best.parallelism.virtual_stages,
                "memory": best.predicted.peak_memory_bytes / 1e9, "note": ""}

    out = accuracy.zero_bubble_row(row, price)
    zb = out["schedules"]
    assert zb["zb-interleaved"]["published"] == pytest.approx(12.9 / 11.8)
    assert out["published_zb_2p"] == pytest.approx(14.5 / 11.8)
    assert zb["zbv"]["published"] is None and zb["dualpipev"]["published"] is None
    for schedule in ZERO_BUBBLE_SCHEDULES:
        assert zb[schedule]["predicted"] == pytest.approx(priced["1f1b"] / priced[schedule])
        assert zb[schedule]["predicted"] > 1.0
    error = zb["zb-interleaved"]["error"]
    assert error == pytest.approx(zb["zb-interleaved"]["predicted"] / (12.9 / 11.8) - 1)
    assert out["predicted_1f1b"] == pytest.approx(6 * 24 / priced["1f1b"] / 8)


@pytest.mark.parametrize("virtual", [1, 2])
def test_pinned_virtual_stages_are_the_ones_priced(virtual):
    """A Layout pinning virtual_stages (benchmarks/accuracy.py pins ZB-H1's one stage per rank) gets exactly those:
    the search does not pick another count for the schedule."""
    from chain_fixtures import a100_cluster, gpt_profile

    from autoplan.plan import Training
    from autoplan.solve.search import search

    profile = gpt_profile(n_layer=8, n_embd=256, vocab=1024, seq=128, batch=2, n_head=4, device="a100-sxm4-80gb")
    pins = Layout(tp=1, pp=2, dp=1, schedule="zb-interleaved", compile="off", recompute="none", microbatch=2,
                  virtual_stages=virtual)
    best = search(profile, a100_cluster(2), Training(global_batch_size=16, dtype="bf16"), pins).best
    assert best.parallelism.virtual_stages == virtual


def _data_parallel_comm(schedule: str, *, overlap: float = 1.0, tensor_overhead_s: float = 0.0, zero: int = 0) -> float:
    """The predicted data_parallel_comm of a dp=2 x pp=2 x 2-stages-per-rank step of a 16-module GPT
(12 layers of width 1024)."""
    from dataclasses import replace

    from chain_fixtures import gpt_profile
    from test_cost import _ctx, _par

    from autoplan.cost.context import Context
    from autoplan.cost.evaluate import build_problem, evaluate
    from autoplan.cost.problem import Split

    base = _ctx(gpt_profile(n_layer=12, n_embd=1024), gpus=4, batch=8)  # stages of several DDP buckets
    gpu = replace(base.cluster.gpu, comm_overlap=overlap, ddp_tensor_overhead_s=tensor_overhead_s)
    ctx = Context(base.profile, replace(base.cluster, hardware=replace(base.cluster.hardware, gpu=gpu)),
                  base.training, base.features)
    par = _par(dp=2, pp=2, zero=zero, schedule=schedule, v=2, m=4)
    problem = build_problem(ctx, par, ("none",))
    candidate = evaluate(ctx, par, problem, problem.uniform(Split((0, 4, 8, 12, 16))), True)
    return candidate.predicted.time_breakdown["data_parallel_comm"]


def test_ddp_under_a_zero_bubble_schedule_pays_one_flat_all_reduce_after_the_last_weight_pass():
    """The program (runtime/distributed/split_backward.py) all-reduces a DDP stage's gradients in one flat buffer after its last
    weight pass, no DDP hook firing: nothing hides it and DDP's time per parameter tensor is not paid. The interleaved
    1F1B's DDP buckets hide behind the last backward."""
    for schedule in ZERO_BUBBLE_SCHEDULES:
        exposed = _data_parallel_comm(schedule)
        assert exposed > 0
        assert _data_parallel_comm(schedule, overlap=0.0) == pytest.approx(exposed)
        assert _data_parallel_comm(schedule, tensor_overhead_s=1e-3) == pytest.approx(exposed)
    assert _data_parallel_comm("interleaved", overlap=0.0) > _data_parallel_comm("interleaved")
    assert _data_parallel_comm("interleaved", tensor_overhead_s=1e-3) > _data_parallel_comm("interleaved")


def test_fsdp_under_a_zero_bubble_schedule_reduce_scatters_once_per_step_as_under_interleaved_1f1b():
    """FSDP2 under any pipeline reduce-scatters once after the stage's last backward (for the zero-bubble schedules,
    its last weight pass): the same collectives as the interleaved 1F1B's, on the same stage placement."""
    for zero in (2, 3):
        assert _data_parallel_comm("zb-interleaved", zero=zero) == pytest.approx(_data_parallel_comm("interleaved", zero=zero))
