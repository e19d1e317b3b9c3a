"""float8 linears, priced only (cost/float8.py): a Linear's time against the closed form of torchao's roofline model
(GEMMs at the float8 peak, plus the casts' bytes at the streaming bandwidth and their launches), the ops left in
bf16, and the planner's refusals (no program is written with float8, no float8 peak, fp32 training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoplan.cost.compute import TableSetting, module_table
from autoplan.cost.module_costs import ChainCosts, ModuleCosts, OpCost
from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware
from autoplan.hardware.types import Link

H100 = load_hardware("h100-sxm5-80gb").gpu
LINK = Link("nvlink", 470e9, 20e-6, "test")
TOKENS, HIDDEN, FFN = 8192, 4096, 14336
"""One sample of 8192 tokens through a 4096 -> 14336 Linear, captured in bf16 (2 bytes per element)."""


def _linear(role: str = "", kind: str = "gemm", parameters: bool = True) -> OpCost:
    x, w, y = TOKENS * HIDDEN * 2, HIDDEN * FFN * 2, TOKENS * FFN * 2
    flops = 2 * TOKENS * HIDDEN * FFN
    return OpCost(kind=kind, tp_role=role, flops_fwd=flops, flops_bwd=2 * flops, activation_bytes=x + y,
                  parameter_bytes=w if parameters else 0.0, input_activation_bytes=x, output_bytes=y, saved_bytes=x,
                  saved_scales=True, has_backward=True, time_fwd_s=0.0, time_bwd_s=0.0, measured=False,
                  profile_batch=1)


def _times(op: OpCost, float8: str | None, compiled: bool = True, tp: int = 1) -> tuple[float, float]:
    module = ModuleCosts(ops=(op,), input_bytes=0.0, output_buffer_bytes=0.0, replicated_numel=0, split_numel=0)
    costs = ChainCosts(modules=(module,), signature=(0,), tied_split=(), measured=False)
    table = module_table(costs, TableSetting(gpu=H100, capture_dtype="bf16", train_dtype="bf16", tp=tp, microbatch=1,
                                             tp_link=LINK, use_measured=False, compiled=compiled,
                                             float8_linears=float8))
    return table.forward_s[0], table.backward_s[0]


BANDWIDTH = 3350e9 * 0.8  # H100 HBM3 x memory_efficiency (profiles/h100-sxm5-80gb.yaml)
LAUNCH = 5e-6


def test_h100_profile_has_the_datasheet_float8_peak():
    assert H100.peak_flops["fp8"] == 1979e12
    assert load_hardware("h200-sxm-141gb").gpu.peak_flops["fp8"] == 1979e12


def test_a_float8_linear_is_its_gemms_at_the_float8_peak_plus_its_casts():
    flops = 2 * TOKENS * HIDDEN * FFN
    x, w, y = TOKENS * HIDDEN, HIDDEN * FFN, TOKENS * FFN
    gemm = 1979e12 * 0.65
    # compiled: the input's and the output gradient's amax fused with their producers (4 bytes per element:
    # read bf16, write float8 twice), the weight's amax its own pass (6); launches: 2 + 3 forward, 2 backward
    forward, backward = _times(_linear(), float8="torchao")
    assert forward == pytest.approx(flops / gemm + (4 * x + 6 * w) / BANDWIDTH + LAUNCH + 5 * LAUNCH)
    assert backward == pytest.approx(2 * flops / gemm + 4 * y / BANDWIDTH + 2 * LAUNCH + 2 * LAUNCH)
    # eager: every amax its own pass
    forward, backward = _times(_linear(), float8="torchao", compiled=False)
    assert forward == pytest.approx(flops / gemm + (6 * x + 6 * w) / BANDWIDTH + LAUNCH + 6 * LAUNCH)
    assert backward == pytest.approx(2 * flops / gemm + 6 * y / BANDWIDTH + 2 * LAUNCH + 3 * LAUNCH)


def test_transformer_engine_casts_without_amax_passes_and_caches_the_weights():
    """Delayed scaling: no amax pass (the scale comes from the recorded history); the weight's float8 copy made
    once per step (is_first_microbatch): per micro-batch only the input's and the output gradient's casts, 4 bytes per
    element and one launch each, compiled or not."""
    flops = 2 * TOKENS * HIDDEN * FFN
    x, y = TOKENS * HIDDEN, TOKENS * FFN
    gemm = 1979e12 * 0.65
    for compiled in (True, False):
        forward, backward = _times(_linear(), float8="transformer_engine", compiled=compiled)
        assert forward == pytest.approx(flops / gemm + 4 * x / BANDWIDTH + LAUNCH + LAUNCH)
        assert backward == pytest.approx(2 * flops / gemm + 4 * y / BANDWIDTH + 2 * LAUNCH + LAUNCH)
    assert sum(_times(_linear(), "transformer_engine")) < sum(_times(_linear(), "torchao"))


def test_float8_is_faster_than_bf16_on_a_large_linear_but_not_twice():
    bf16 = sum(_times(_linear(), float8=None))
    fp8 = sum(_times(_linear(), float8="torchao"))
    assert bf16 / 2 < fp8 < bf16


def test_tensor_parallel_ranks_cast_their_shards():
    flops = 2 * TOKENS * HIDDEN * FFN
    x, w, y = TOKENS * HIDDEN, HIDDEN * FFN, TOKENS * FFN
    gemm = 1979e12 * 0.65
    forward, backward = _times(_linear("colwise"), float8="torchao", tp=4)  # input whole, weight and output / 4
    assert forward == pytest.approx(flops / 4 / gemm + (4 * x + 6 * w / 4) / BANDWIDTH + 6 * LAUNCH)
    assert backward == pytest.approx(2 * flops / 4 / gemm + 4 * y / 4 / BANDWIDTH + 4 * LAUNCH)
    forward, backward = _times(_linear("rowwise"), float8="torchao", tp=4)  # input and weight / 4, output whole
    assert forward == pytest.approx(flops / 4 / gemm + (4 * x / 4 + 6 * w / 4) / BANDWIDTH + 6 * LAUNCH)
    assert backward == pytest.approx(2 * flops / 4 / gemm + 4 * y / BANDWIDTH + 4 * LAUNCH)


@pytest.mark.parametrize("op", [_linear("head"), _linear(kind="attention", parameters=False),
                                _linear(parameters=False)], ids=["output layer", "attention", "activation matmul"])
def test_what_float8_training_leaves_in_bf16(op):
    assert _times(op, float8="torchao") == _times(op, float8=None)


MODEL = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def test_float8_linears_are_priced_only():
    import autoplan

    with pytest.raises(UserError, match="priced only"):
        autoplan.plan(str(MODEL), 2, "h100-sxm5-80gb", pin="dp=2", float8_linears="torchao", out="unused")
    with pytest.raises(UserError, match="no float8 peak"):
        autoplan.estimate(str(MODEL), 2, "dp=2", "a100-sxm4-80gb", float8_linears="torchao")
    with pytest.raises(UserError, match="bf16 training"):
        autoplan.estimate(str(MODEL), 2, "dp=2", "h100-sxm5-80gb", dtype="fp32", float8_linears="torchao")
    with pytest.raises(UserError, match="float8_linears must be one of torchao, transformer_engine"):
        autoplan.estimate(str(MODEL), 2, "dp=2", "h100-sxm5-80gb", float8_linears="fp8")
    assert not Path("unused").exists()


def test_estimate_prices_float8_linears_on_the_same_layout():
    """examples/gpt.py's Linears are tiny (128 features): the casts' launches outweigh the faster GEMMs, as torchao
    warns float8 pays only on large ones."""
    import autoplan

    bf16 = autoplan.estimate(str(MODEL), 2, "dp=2,microbatch=8", "h100-sxm5-80gb", global_batch=16)
    fp8 = autoplan.estimate(str(MODEL), 2, "dp=2,microbatch=8", "h100-sxm5-80gb", global_batch=16,
                            float8_linears="torchao")
    assert fp8.predicted.step_time_s > bf16.predicted.step_time_s
    assert fp8.parallelism == bf16.parallelism
