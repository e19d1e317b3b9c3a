"""Grouped expert matmuls (torch._grouped_mm over stacked expert weights) priced at the efficiency measured for them
(calibration.GROUPED_GEMM_EFFICIENCY of the dense matmul efficiency), against the closed form of the roofline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.cost import calibration
from autoplan.cost.compute import TableSetting, module_table
from autoplan.cost.module_costs import ChainCosts, ModuleCosts, OpCost
from autoplan.hardware.profiles import load_hardware
from autoplan.hardware.types import Link

H100 = load_hardware("h100-sxm5-80gb").gpu
LINK = Link("nvlink", 470e9, 20e-6, "test")
EXPERTS, ROWS, HIDDEN, FFN = 64, 1536, 2048, 1408
"""DeepSeek-V3-16B's expert up-projection: 64 experts of 1536 routed rows each, 2048 -> 2 x 1408."""


def _experts_matmul(grouped: bool) -> OpCost:
    m = EXPERTS * ROWS
    x, w, y = m * HIDDEN * 2, EXPERTS * HIDDEN * 2 * FFN * 2, m * 2 * FFN * 2
    flops = 2 * m * HIDDEN * 2 * FFN
    return OpCost(kind="gemm", tp_role="", flops_fwd=flops, flops_bwd=2 * flops, activation_bytes=x + y,
                  parameter_bytes=w, input_activation_bytes=x, output_bytes=y, saved_bytes=x, saved_scales=True,
                  has_backward=True, time_fwd_s=0.0, time_bwd_s=0.0, measured=False, profile_batch=1,
                  grouped=grouped)


def _times(op: OpCost) -> tuple[float, float]:
    module = ModuleCosts(ops=(op,), input_bytes=0.0, output_buffer_bytes=0.0, replicated_numel=0, split_numel=0)
    costs = ChainCosts(modules=(module,), signature=(0,), tied_split=(), measured=False)
    table = module_table(costs, TableSetting(gpu=H100, capture_dtype="bf16", train_dtype="bf16", tp=1, microbatch=1,
                                             tp_link=LINK, use_measured=False, compiled=False))
    return table.forward_s[0], table.backward_s[0]


def test_a_grouped_expert_matmul_runs_at_the_measured_fraction_of_the_dense_efficiency():
    op = _experts_matmul(grouped=True)
    rate = H100.peak_flops["bf16"] * H100.matmul_efficiency * calibration.GROUPED_GEMM_EFFICIENCY
    forward, backward = _times(op)
    assert forward == pytest.approx(op.flops_fwd / rate + H100.kernel_overhead_s)
    assert backward == pytest.approx(op.flops_bwd / rate + 2 * H100.kernel_overhead_s)
    dense_forward, _ = _times(replace(op, grouped=False))
    assert dense_forward == pytest.approx(op.flops_fwd / (rate / calibration.GROUPED_GEMM_EFFICIENCY)
                                          + H100.kernel_overhead_s)
    assert forward > dense_forward


def test_the_grouped_efficiency_is_a_fraction():
    assert 0 < calibration.GROUPED_GEMM_EFFICIENCY < 1
