"""cost.expert_parallel: the all-to-all time against its closed form, the router imbalance against a
simulated uniform router, and the expert weights a rank holds."""

import math
import random

import pytest

from autoplan.chain.experts import ExpertLayer
from autoplan.cost.comm import Group
from autoplan.cost.expert_parallel import ALL_TO_ALLS_PER_LAYER, expert_parallel_cost, router_imbalance
from autoplan.hardware.types import Link

LAYER = ExpertLayer(module="layers.0.mlp.experts", router="layers.0.mlp.gate", parameters=("a", "b"),
                    num_experts=64, top_k=8, tokens=4096, hidden=2048, parameter_numel=64 * 3 * 2048 * 1408)
NVLINK = Link("nvlink", bus_bandwidth_bytes_per_s=360e9, latency_s=20e-6, source="test")


def test_the_four_all_to_alls_move_the_busiest_ranks_rows_that_leave_it():
    cost = expert_parallel_cost(LAYER, tokens_per_microbatch=8192, bytes_per_element=2, group=Group(8, NVLINK))
    rows = 8192 * 8
    busiest = rows * router_imbalance(rows * 8, 8, LAYER.num_experts, LAYER.top_k)  # it receives the most rows
    one = 20e-6 + busiest * 2048 * 2 * (7 / 8) / 360e9
    assert cost.rows == rows
    assert cost.all_to_all_s == pytest.approx(ALL_TO_ALLS_PER_LAYER * one, rel=1e-12)
    assert cost.expert_parameter_numel == LAYER.parameter_numel / 8


def test_one_rank_moves_nothing_and_holds_every_expert():
    cost = expert_parallel_cost(LAYER, 8192, 2, Group(1, NVLINK))
    assert (cost.all_to_all_s, cost.imbalance, cost.expert_parameter_numel) == (0.0, 1.0, LAYER.parameter_numel)


@pytest.mark.parametrize("rows, degree", [(4096, 8), (512, 4), (20000, 16)])
def test_the_imbalance_is_the_busiest_rank_of_a_uniform_router(rows, degree):
    rng = random.Random(0)
    trials = 300
    ratios = []
    for _ in range(trials):
        counts = [0] * degree
        for _ in range(rows):
            counts[rng.randrange(degree)] += 1
        ratios.append(max(counts) / (rows / degree))
    simulated = sum(ratios) / trials
    assert router_imbalance(rows, degree) == pytest.approx(simulated, rel=0.03)  # the Gaussian maximum's error
    assert router_imbalance(rows, 1) == 1.0


def test_a_measured_router_ratio_replaces_the_uniform_one():
    assert expert_parallel_cost(LAYER, 8192, 2, Group(8, NVLINK), measured_imbalance=1.7).imbalance == 1.7
    uniform = expert_parallel_cost(LAYER, 8192, 2, Group(8, NVLINK)).imbalance
    assert uniform == pytest.approx(router_imbalance(8192 * 8 * 8, 8, LAYER.num_experts, LAYER.top_k))


def test_measured_rows_group_as_the_ranks_hold_the_experts():
    from autoplan.cost.expert_parallel import measured_imbalance

    rows = [10, 30, 5, 5, 20, 20, 6, 4]  # 100 rows over 8 experts
    assert measured_imbalance(rows, 2) == pytest.approx(50 / 50)  # experts 0-3 and 4-7: 50 rows each
    assert measured_imbalance(rows, 4) == pytest.approx(40 / 25)  # pairs hold 40, 10, 40, 10
    assert measured_imbalance(rows, 8) == pytest.approx(30 / 12.5)  # expert 1 alone
    assert measured_imbalance(rows, 1) is None and measured_imbalance(rows, 3) is None
    assert measured_imbalance([], 2) is None and measured_imbalance([0, 0], 2) is None
