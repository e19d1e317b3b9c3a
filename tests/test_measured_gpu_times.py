"""`autoplan profile --measure` / `autoplan MODEL --measure` on a GPU machine: ops are timed in the plan's
training dtype (bf16: what FSDP2's mixed precision and autocast run), and the planner prices a GPU plan with
those measured times instead of the roofline (a CPU-timed profile still never prices a GPU plan)."""

from dataclasses import replace

import pytest
import torch
from chain_fixtures import cluster, gpt_profile

from autoplan.cost.context import TableKey
from autoplan.cost.context import Context
from autoplan.layout import SUPPORTED
from autoplan.plan import Training
from autoplan.profile import measure
from autoplan.profile.replay import OpCall, Slot, SlotSpec, make_inputs
from autoplan.profile.measure import device_description, timed_dtype


def test_gpu_ops_are_timed_in_the_training_dtype():
    assert timed_dtype("cuda", "bf16") is torch.bfloat16
    assert timed_dtype("cuda", "fp32") is None and timed_dtype("cpu", "bf16") is None  # CPU plans train in fp32
    # another timed dtype is another timing cache
    assert device_description("cpu", torch.bfloat16) != device_description("cpu", None)


def test_float_inputs_are_made_in_the_timed_dtype():
    """The op's float32 slots become bf16, its integer slots (indices) stay as captured."""
    graph_call = _embedding_call()
    leaves, _ = make_inputs(graph_call, fill=True, float_dtype=torch.bfloat16)
    assert [t.dtype for t in leaves] == [torch.bfloat16, torch.int64]
    timing = measure.measure_call(graph_call, "cpu", torch.bfloat16)
    assert timing.forward_s > 0


def _embedding_call() -> OpCall:
    weight = SlotSpec(shape=(16, 8), stride=(8, 1), dtype=torch.float32, requires_grad=True)
    ids = SlotSpec(shape=(4,), stride=(1,), dtype=torch.int64, requires_grad=False)
    return OpCall(target=torch.ops.aten.embedding.default, args=(Slot(0), Slot(1)), kwargs={},
                  slots=(weight, ids), grad_enabled=True)


def _forward_s(ctx: Context) -> float:
    return sum(ctx.table(TableKey(1, ctx.profile.batch_size)).forward_s)


def test_a_gpu_plan_is_priced_with_gpu_measured_times():
    measured_cpu = gpt_profile(n_layer=2)  # ops "measured", device cpu
    measured_gpu = replace(measured_cpu, device="cuda")
    on_gpu = Context(measured_gpu, cluster(1), Training(2, "bf16"), SUPPORTED)
    on_cpu_times = Context(measured_cpu, cluster(1), Training(2, "bf16"), SUPPORTED)
    assert on_gpu.use_measured and not on_cpu_times.use_measured
    # at the profiled batch, one GPU, eager: each module's forward is its ops' measured times
    ops = sum(op.time_fwd_s for op in measured_gpu.ops)
    assert _forward_s(on_gpu) == pytest.approx(ops, rel=1e-9)
    assert _forward_s(on_cpu_times) != pytest.approx(ops, rel=1e-3)  # the roofline
