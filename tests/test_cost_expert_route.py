"""Expert compute and all-to-all priced as the program runs them (cost/expert_parallel.py route_s,
cost/module_costs.py OpCost.kept_by_selective, cost/compute.py ModuleTable.selective_recompute_s): the route's
permutation passes, id and count exchanges and host syncs around the rows' all-to-alls; selective recompute
running the grouped expert matmuls and the route's passes again, as runtime/distributed/recompute.py's save list leaves them
out, and keeping the route's all-to-all outputs, as it keeps them."""

import math
import random

import pytest

from autoplan.chain.experts import ExpertLayer
from autoplan.cost.comm import Group
from autoplan.cost.compute import ModuleTable
from autoplan.cost.expert_parallel import (ID_BYTES, ROUTE_BACKWARD_PASSES, ROUTE_FORWARD_PASSES, ROUTE_HOST_SYNCS,
                                           expert_parallel_cost, route_s)
from autoplan.cost.module_costs import ModuleCosts, OpCost, saved_by_mode
from autoplan.hardware.types import Link

LAYER = ExpertLayer(module="layers.0.mlp.experts", router="layers.0.mlp.gate", parameters=("a", "b"),
                    num_experts=64, top_k=6, tokens=4096, hidden=2048, parameter_numel=64 * 3 * 2048 * 1408)
NVLINK = Link("nvlink", bus_bandwidth_bytes_per_s=360e9, latency_s=20e-6, source="test")
IB = Link("ib", bus_bandwidth_bytes_per_s=40e9, latency_s=50e-6, source="test")


class _Gpu:
    memory_bandwidth_bytes_per_s = 3.35e12
    memory_efficiency = 0.8
    kernel_overhead_s = 5e-6


def _all_to_all(nbytes: float, n: int, link: Link, nodes: int = 1) -> float:
    import math
    alpha = link.latency_s * (max(1.0, math.log2(nodes)) if nodes > 1 else 1.0)
    return alpha + nbytes * (n - 1) / n / link.bus_bandwidth_bytes_per_s


def test_the_route_costs_its_passes_its_id_and_count_exchanges_and_its_host_syncs():
    rows, stream = 16384 * 6, 3.35e12 * 0.8
    forward, backward = route_s(rows, 2048, 2, Group(8, NVLINK), _Gpu())
    row_bytes = rows * 2048 * 2
    counts = _all_to_all(8 * ID_BYTES, 8, NVLINK)
    ids = _all_to_all(rows * ID_BYTES, 8, NVLINK)
    assert forward == pytest.approx(counts + ids + ROUTE_HOST_SYNCS * 5e-6 + ROUTE_FORWARD_PASSES * row_bytes / stream,
                                    rel=1e-12)
    assert backward == pytest.approx(ROUTE_BACKWARD_PASSES * row_bytes / stream, rel=1e-12)
    # 6 and 8 passes of 403 MB at 2.68 TB/s: about 0.9 and 1.2 ms per layer and micro-batch
    assert 0.85e-3 < forward < 1.0e-3 and 1.15e-3 < backward < 1.25e-3


def test_the_route_exchanges_cross_the_links_of_their_group():
    rows = 16384 * 6
    inside, _ = route_s(rows, 2048, 2, Group(8, NVLINK), _Gpu())
    across, _ = route_s(rows, 2048, 2, Group(16, IB, nodes=2), _Gpu())
    passes = ROUTE_HOST_SYNCS * 5e-6 + ROUTE_FORWARD_PASSES * rows * 2048 * 2 / (3.35e12 * 0.8)
    assert across - passes == pytest.approx(_all_to_all(16 * ID_BYTES, 16, IB, 2) + _all_to_all(rows * ID_BYTES, 16, IB, 2))
    assert across > inside


def test_one_rank_has_no_route():
    assert route_s(98304, 2048, 2, Group(1, NVLINK), _Gpu()) == (0.0, 0.0)
    cost = expert_parallel_cost(LAYER, 16384, 2, Group(1, NVLINK), gpu=_Gpu())
    assert (cost.route_forward_s, cost.route_backward_s) == (0.0, 0.0)


def test_expert_parallel_cost_carries_the_route():
    cost = expert_parallel_cost(LAYER, 16384, 2, Group(8, NVLINK), gpu=_Gpu())
    assert (cost.route_forward_s, cost.route_backward_s) == route_s(16384 * 6, 2048, 2, Group(8, NVLINK), _Gpu())


def _op(kind: str, grouped: bool, output: float, saved: float) -> OpCost:
    return OpCost(kind=kind, tp_role="", flops_fwd=1.0, flops_bwd=2.0, activation_bytes=output, parameter_bytes=0.0,
                  input_activation_bytes=0.0, output_bytes=output, saved_bytes=saved, saved_scales=True,
                  has_backward=True, time_fwd_s=0.0, time_bwd_s=0.0, measured=False, profile_batch=1,
                  grouped=grouped)


def test_selective_recompute_keeps_dense_matmul_outputs_not_grouped_expert_ones():
    dense, grouped = _op("gemm", False, 100.0, 50.0), _op("gemm", True, 1000.0, 500.0)
    assert dense.kept_by_selective and not grouped.kept_by_selective
    module = ModuleCosts(ops=(dense, grouped, _op("memory", False, 10.0, 2000.0)), input_bytes=7.0,
                         output_buffer_bytes=0.0, replicated_numel=0, split_numel=0)
    saved = saved_by_mode(module, tp=1, scale=1.0)
    assert saved["selective"] == 7.0 + 100.0  # the input and the dense matmul's output
    assert saved["none"] == 2550.0


def test_the_program_does_not_save_grouped_matmuls_under_selective():
    """The rule the price follows (kept_by_selective) is the program's: runtime/distributed/recompute.py's save list."""
    import torch

    from autoplan.runtime.distributed.recompute import saved_ops

    assert torch.ops.aten.mm.default in saved_ops()
    assert torch.ops.aten._grouped_mm.default not in saved_ops()
    assert torch.ops._c10d_functional.all_to_all_single.default in saved_ops()  # the route's exchanges


def _table(cheap: float, ep_forward: float, ep_recompute: float) -> ModuleTable:
    return ModuleTable(forward_s=(1.0,), backward_s=(2.0,), tp_forward_s=(0.0,), tp_backward_s=(0.0,),
                       cheap_forward_s=(cheap,), activation_bytes={"none": (0.0,), "selective": (0.0,), "full": (0.0,)},
                       working_bytes=(0.0,), ep_forward_s=(ep_forward,), ep_backward_s=(0.5,),
                       ep_recompute_s=(ep_recompute,))


def test_selective_recompute_runs_the_route_again_but_not_its_all_to_alls():
    """The program keeps the all-to-alls' outputs under selective (runtime/distributed/recompute.py, as torchtitan does): its
    recomputation reruns the route's passes (ep_recompute_s), not the exchanges (ep_forward_s); full reruns both."""
    table = _table(cheap=0.25, ep_forward=0.125, ep_recompute=0.03125)
    assert table.selective_recompute_s(0) == 0.25 + 0.03125
    assert table.time_s("selective")[0] == pytest.approx(1.0 + 2.0 + 0.125 + 0.5 + 0.25 + 0.03125)
    assert table.time_s("full")[0] == pytest.approx(1.0 + 2.0 + 0.125 + 0.5 + 1.0 + 0.125)
    assert _table(cheap=0.25, ep_forward=0.0, ep_recompute=0.0).selective_recompute_s(0) == 0.25


def test_the_route_recomputed_is_its_passes_and_syncs():
    from autoplan.cost.expert_parallel import route_recompute_s

    rows = 16384 * 6
    forward, _ = route_s(rows, 2048, 2, Group(8, NVLINK), _Gpu())
    exchanges = _all_to_all(8 * ID_BYTES, 8, NVLINK) + _all_to_all(rows * ID_BYTES, 8, NVLINK)
    assert route_recompute_s(rows, 2048, 2, Group(8, NVLINK), _Gpu()) == pytest.approx(forward - exchanges, rel=1e-12)
    assert route_recompute_s(rows, 2048, 2, Group(1, NVLINK), _Gpu()) == 0.0


def test_selective_keeps_the_routes_all_to_all_outputs():
    """torchtitan's DeepSeek-V3 16B row (runs_frontier.csv tt-1789: micro-batch 4 x 4096, top-6, hidden 2048, ep 8):
    a rank routes 98,304 rows; selective keeps the rows and ids it receives (the busiest rank's: x the imbalance), its
    rows back and the counts: 2 x 384 MiB per expert layer and micro-batch at an even router."""
    from autoplan.cost.expert_parallel import selective_kept_bytes

    rows = 4 * 4096 * 6
    even = expert_parallel_cost(LAYER, 4 * 4096, 2, Group(8, NVLINK), measured_imbalance=1.0, gpu=_Gpu())
    assert even.selective_kept_bytes == rows * (2048 * 2 + ID_BYTES) + rows * 2048 * 2 + 8 * ID_BYTES
    assert 2 * 384 * 2**20 < even.selective_kept_bytes < 2 * 386 * 2**20
    skewed = expert_parallel_cost(LAYER, 4 * 4096, 2, Group(8, NVLINK), measured_imbalance=1.5, gpu=_Gpu())
    assert skewed.selective_kept_bytes - even.selective_kept_bytes == pytest.approx(0.5 * rows * (2048 * 2 + ID_BYTES))
    assert selective_kept_bytes(rows, 2048, 2, 1.0, 1) == 0.0  # no route at ep = 1
    assert expert_parallel_cost(LAYER, 4 * 4096, 2, Group(1, NVLINK)).selective_kept_bytes == 0.0


def test_the_sharded_table_keeps_the_route_under_selective_only():
    from autoplan.cost.compute import ShardedModules, sharded_table

    base = ModuleTable(forward_s=(1.0,), backward_s=(2.0,), tp_forward_s=(0.0,), tp_backward_s=(0.0,),
                       cheap_forward_s=(0.1,), activation_bytes={"none": (800.0,), "selective": (50.0,),
                                                                  "full": (10.0,)}, working_bytes=(900.0,))
    sharded = ShardedModules(cp=2, expert_forward_s=(1.0,), expert_backward_s=(2.0,), imbalance=(1.0,),
                             ring_forward_s=(0.0,), ring_backward_s=(0.0,), all_to_all_s=(0.08,),
                             route_forward_s=(0.02,), route_recompute_s=(0.01,), route_kept_bytes=(300.0,))
    table = sharded_table(base, sharded)
    assert table.activation_bytes["selective"] == pytest.approx((50.0 / 2 + 300.0,))  # the route's bytes are per rank
    assert table.activation_bytes["none"] == pytest.approx((400.0,))
    assert table.activation_bytes["full"] == pytest.approx((5.0,))
    assert table.selective_recompute_s(0) == pytest.approx(0.1 / 2 + 0.01)


@pytest.mark.parametrize("name", ["aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"])
def test_grouped_expert_matmuls_are_priced_as_matmuls(name):
    """A capture on fake tensors records transformers' fallback op, a GPU run aten._grouped_mm; neither lists the
    stacked weights as parameters (it reads views of them), and both are matmuls priced at matmul efficiency."""
    from autoplan.chain.ops import cost_kind
    from autoplan.profile_data import OpProfile

    op = OpProfile(node="g", op=name, module="layers.0.mlp.experts", module_stack=("layers.0.mlp.experts",),
                   inputs=("rows", "weight", "offsets"), params=(), input_shapes=((96, 32), (4, 32, 64), (4,)),
                   dtype="float32", flops_fwd=2 * 96 * 32 * 64, flops_bwd=4 * 96 * 32 * 64, input_bytes=0,
                   output_bytes=96 * 64 * 4, saved_bytes=0, time_fwd_s=0.0, time_bwd_s=0.0, source="estimated")
    assert cost_kind(op) == "gemm"


def test_the_expected_maximum_of_standard_normals():
    from autoplan.cost.expert_parallel import expected_normal_maximum

    assert expected_normal_maximum(1) == 0.0
    assert expected_normal_maximum(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)  # closed forms
    assert expected_normal_maximum(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-9)
    assert expected_normal_maximum(8) == pytest.approx(1.4236, abs=1e-4)  # order-statistics tables


@pytest.mark.parametrize("tokens, experts, top_k, degree", [(256, 8, 4, 2), (512, 64, 6, 8), (256, 128, 8, 16)])
def test_the_busiest_rank_of_a_top_k_router_over_distinct_experts(tokens, experts, top_k, degree):
    """Each token sends its k rows to k distinct experts drawn uniformly; rank r holds experts r E/ep ..: the
    busiest rank's rows over the mean, simulated, against router_imbalance's closed form (its excess over 1
    within 10%; the binomial form without the (E - k) / (E - 1) factor and with sqrt(2 ln ep) is 25-100% off)."""
    from autoplan.cost.expert_parallel import router_imbalance

    rng = random.Random(0)
    share, trials, ratios = experts // degree, 400, []
    for _ in range(trials):
        counts = [0] * degree
        for _ in range(tokens):
            for expert in rng.sample(range(experts), top_k):
                counts[expert // share] += 1
        ratios.append(max(counts) * degree / (tokens * top_k))
    simulated = sum(ratios) / trials
    assert router_imbalance(tokens * top_k, degree, experts, top_k) - 1 == pytest.approx(simulated - 1, rel=0.10)


def test_a_skewed_router_slows_the_all_to_alls_by_its_busiest_rank():
    even = expert_parallel_cost(LAYER, 16384, 2, Group(8, NVLINK), measured_imbalance=1.0)
    skewed = expert_parallel_cost(LAYER, 16384, 2, Group(8, NVLINK), measured_imbalance=1.5)
    alpha = 4 * 20e-6
    assert skewed.all_to_all_s - alpha == pytest.approx(1.5 * (even.all_to_all_s - alpha), rel=1e-12)


def test_the_busiest_rank_holds_and_recomputes_its_experts_extra_rows():
    """A rank receiving 1.5 times the mean rows saves 1.5 times what its experts save for the mean rows (kept
    without recompute, and in the working set of its backward), and reruns 1.5 times their forward under
    selective recompute."""
    from autoplan.cost.compute import ShardedModules, busiest_rank_expert_bytes, sharded_table

    base = ModuleTable(forward_s=(1.0, 2.0), backward_s=(2.0, 4.0), tp_forward_s=(0.0, 0.0), tp_backward_s=(0.0, 0.0),
                       cheap_forward_s=(0.1, 0.6), activation_bytes={"none": (100.0, 800.0), "selective": (40.0, 50.0),
                                                                      "full": (10.0, 10.0)},
                       working_bytes=(100.0, 900.0))
    sharded = ShardedModules(cp=1, expert_forward_s=(0.0, 1.0), expert_backward_s=(0.0, 2.0), imbalance=(1.0, 1.5),
                             ring_forward_s=(0.0, 0.0), ring_backward_s=(0.0, 0.0), all_to_all_s=(0.0, 0.08),
                             saved_change_bytes=(0.0, 0.0), input_change_bytes=(0.0, 0.0),
                             expert_cheap_forward_s=(0.0, 0.4), expert_saved_bytes=(0.0, 600.0))
    assert busiest_rank_expert_bytes(sharded, 2) == pytest.approx((0.0, 300.0))
    table = sharded_table(base, sharded)
    assert table.activation_bytes["none"] == pytest.approx((100.0, 800.0 + 300.0))
    assert table.activation_bytes["selective"] == pytest.approx((40.0, 50.0))  # the experts' rows are not kept
    assert table.working_bytes == pytest.approx((100.0, 900.0 + 300.0))
    assert table.cheap_forward_s == pytest.approx((0.1, 0.6 + 0.5 * 0.4))
