"""Receives are posted where torch's pipelining runtime posts them, and transfers wait for them."""

import itertools
import types

import pytest
from torch.distributed.pipelining import schedules

from autoplan.cost.pipeline import StageCost, rank_order, simulate
from autoplan.cost.pipeline_recv import receive_posted_after


def _torch_receive_positions(p: int, v: int, m: int) -> dict[tuple[str, int, int], int]:
    """torch's own lowering of ScheduleInterleaved1F1B (compute order, UNSHARD/RESHARD, REDUCE_GRAD,
    sends and receives), read back as: produced output -> receiver's compute index it follows."""
    compute = {}
    for rank in range(p):
        rounds = max(1, m // p)
        schedule = types.SimpleNamespace(pp_group_size=p, n_local_stages=v, rank=rank, _n_microbatches=m,
                                         number_of_rounds=rounds, microbatches_per_round=m // rounds,
                                         _num_stages=p * v)
        compute[rank] = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
    lowered = {r: schedules._add_reduce_grad(schedules._add_unshard_reshard(ops), m) for r, ops in compute.items()}
    with_comms = schedules._add_send_recv(lowered, stage_to_rank=lambda stage: stage % p, num_stages=p * v)
    positions = {}
    for actions in with_comms.values():
        computed = 0
        for action in actions:
            kind = action.computation_type
            if kind in (schedules.F, schedules.FULL_BACKWARD):
                computed += 1
            elif kind == schedules.RECV_F:
                positions[("F", action.stage_index - 1, action.microbatch_index)] = computed - 1
            elif kind == schedules.RECV_B:
                positions[("B", action.stage_index + 1, action.microbatch_index)] = computed - 1
    return positions


@pytest.mark.parametrize("p, v, m", [c for c in itertools.product((2, 3, 4), (2, 3, 4), (2, 4, 6, 8, 12)) if c[2] % c[0] == 0])
def test_interleaved_receives_are_posted_where_torch_lowering_puts_them(p, v, m):
    orders = [rank_order("interleaved", p, m, r, v) for r in range(p)]
    assert receive_posted_after(orders, m, v) == _torch_receive_positions(p, v, m)


def test_single_stage_schedules_post_each_receive_right_before_its_use():
    orders = [rank_order("gpipe", 2, 2, r) for r in range(2)]  # rank 1: F0 F1 B0 B1; rank 0 the same
    assert receive_posted_after(orders, 2, 1) == {("F", 0, 0): -1, ("F", 0, 1): 0, ("B", 1, 0): 1, ("B", 1, 1): 2}


def test_a_transfer_waits_for_its_receiver_to_post_the_receive():
    # GPipe, 2 ranks, 2 micro-batches, F=1 B=2, 0.5 per transfer. Rank 1 posts micro-batch 1's receive
    # only after its F0 (ends 2.5), so that transfer runs 2.5-3.0 although rank 0 sent at 2; rank 0
    # posts B1's receive after its B0 (ends 8.5): 6.5 B0 8.5, transfer, 9.0 B1 11.0.
    stages = [StageCost(1.0, 2.0, send_s=0.5), StageCost(1.0, 2.0)]
    run = simulate("gpipe", 2, 2, stages)
    assert run.makespan_s == pytest.approx(11.0)
    rank1_f1 = next(op for op in run.ops if op.rank == 1 and op.kind == "F" and op.microbatch == 1)
    assert rank1_f1.start_s == pytest.approx(3.0)
