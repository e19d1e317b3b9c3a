"""BatchNorm and other cross-sample state (issue 17): detection in the captured graph, the layout rule
against micro-batches, pricing SyncBatchNorm, plan.json's batch_norm_modules, the runtime's synchronized
batch norm on CPU/gloo, and a dp=2 program whose losses and running statistics match the single-device
model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.chain.batch_statistics import BatchStatistics, batch_statistics, batch_statistics_modules
from autoplan.layout import Layout, Scope, problems, schedule_problems
from autoplan.profile_data import ModelProfile, OpProfile

ROOT = Path(__file__).resolve().parent.parent
RESNET = ROOT / "examples" / "resnet.py"
BN = ("stem.1", "blocks.0.bn1")


def _op(node: str, op: str, module: str, shape: tuple[int, ...]) -> OpProfile:
    return OpProfile(node=node, op=op, module=module, module_stack=tuple(module.split(".")[:1]) + (module,),
                     inputs=(), params=(), input_shapes=(shape,), dtype="float32", flops_fwd=0.0, flops_bwd=0.0,
                     input_bytes=0, output_bytes=0, saved_bytes=0, time_fwd_s=0.0, time_bwd_s=0.0, source="estimated")


def _profile(*ops: OpProfile) -> ModelProfile:
    return ModelProfile(model="m.py", batch_size=2, dtype="float32", device="cpu", ops=ops)


# detection ------------------------------------------------------------------------------------------

def test_batch_norm_ops_are_found_with_their_channels_and_eval_mode_is_not():
    profile = _profile(_op("conv", "aten.conv2d.default", "c", (2, 3, 8, 8)),
                       _op("bn", "aten.batch_norm.default", "stem.1", (2, 16, 8, 8)),
                       _op("bn2", "aten._native_batch_norm_legit_functional.default", "blocks.0.bn1", (2, 32, 4)),
                       _op("bn3", "aten._native_batch_norm_legit_no_training.default", "frozen", (2, 8)),
                       _op("gn", "aten.group_norm.default", "gn", (2, 16, 8, 8)),
                       _op("bn4", "aten.batch_norm.default", "stem.1", (2, 16, 8, 8)))
    calls = batch_statistics(profile)
    assert calls == (BatchStatistics("stem.1", 16), BatchStatistics("blocks.0.bn1", 32), BatchStatistics("stem.1", 16))
    assert batch_statistics_modules(calls) == BN


def test_the_resnet_example_is_detected():
    from autoplan.api import ProfileOptions, profile_only

    profile = profile_only(str(RESNET), "h100-sxm5-80gb", ProfileOptions(measure=False))
    modules = batch_statistics_modules(batch_statistics(profile))
    assert modules[:2] == ("stem.1", "blocks.0.bn1") and "blocks.2.shortcut.1" in modules
    assert len(modules) == 15


# the layout rule ------------------------------------------------------------------------------------

def test_micro_batches_of_a_batch_norm_model_are_refused_naming_the_module():
    scope = Scope(num_gpus=2, global_batch=8, batch_norm_modules=BN)
    split = Layout(dp=2, tp=1, pp=1, microbatch=2)
    found = problems(split, scope)
    assert len(found) == 1 and "global batch 8 / dp=2 / microbatch=2 = 2 micro-batches" in found[0]
    assert "BatchNorm module 'stem.1' (and 1 more)" in found[0] and "microbatches=1" in found[0]
    assert schedule_problems(split, scope) == found  # the search's inner loop refuses it too
    assert problems(replace(split, microbatch=4), scope) == []
    assert problems(split, replace(scope, batch_norm_modules=())) == []


def test_pipeline_micro_batches_of_a_batch_norm_model_are_refused():
    scope = Scope(num_gpus=4, global_batch=8, batch_norm_modules=BN[:1])
    found = problems(Layout(dp=1, tp=1, pp=4, schedule="1f1b", microbatches=4, microbatch=2), scope)
    assert any("microbatches=4 micro-batches per data-parallel rank, but BatchNorm module 'stem.1' normalizes"
               in p for p in found), found


def test_pipeline_with_data_parallelism_is_refused_for_batch_norm():
    scope = Scope(num_gpus=4, global_batch=8, batch_norm_modules=BN)
    found = problems(Layout(dp=2, tp=1, pp=2, schedule="gpipe", microbatch=4), scope)
    assert found == ["pp=2 with dp=2: BatchNorm module 'stem.1' (and 1 more) needs SyncBatchNorm over the "
                     "data-parallel ranks, which a pipeline stage's exported graph cannot run (use pp=1 or dp=1)"]


# the runtime's synchronized batch norm -----------------------------------------------------------------

@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("momentum", [0.1, None])
def test_cpu_sync_batch_norm_trains_like_batch_norm(one_process_group, momentum):
    """Outputs, input and parameter gradients and the running statistics (over 3 steps) of
    DataParallelBatchNorm equal nn.BatchNorm2d's on the same batch."""
    import torch
    from torch import nn

    from autoplan.runtime.distributed.batchnorm import DataParallelBatchNorm, _data_parallel_copy

    torch.manual_seed(0)
    reference = nn.BatchNorm2d(6, momentum=momentum)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    synced = _data_parallel_copy(_clone(reference), one_process_group)
    assert isinstance(synced, DataParallelBatchNorm)
    for _ in range(3):
        x = torch.randn(4, 6, 5, 5) * 3 + 1
        grad = torch.randn(4, 6, 5, 5)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = synced(mine), reference(theirs)
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(synced.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(synced.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-4)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(synced, name), getattr(reference, name), rtol=1e-5, atol=1e-6)
    assert int(synced.num_batches_tracked) == 3
    synced.eval()
    reference.eval()
    x = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(synced(x), reference(x), rtol=1e-5, atol=1e-5)


TWO_RANKS = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from autoplan.runtime.distributed.batchnorm import _data_parallel_copy

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
reference = nn.BatchNorm2d(6)
with torch.no_grad():
    reference.weight.uniform_(0.5, 1.5)
    reference.bias.uniform_(-0.5, 0.5)
synced = _data_parallel_copy(nn.BatchNorm2d(6).requires_grad_(), dist.group.WORLD)
synced.load_state_dict(reference.state_dict())
x = torch.randn(8, 6, 3, 3) * 2 + 1  # the same global batch on both ranks (same seed)
grad = torch.randn(8, 6, 3, 3)
whole = x.clone().requires_grad_()
reference(whole).backward(grad)
mine = x[4 * rank:4 * rank + 4].clone().requires_grad_()
out = synced(mine)
out.backward(grad[4 * rank:4 * rank + 4])
for p in (synced.weight, synced.bias):  # DDP's gradient all-reduce (a sum: the loss is a sum over samples)
    dist.all_reduce(p.grad)
torch.testing.assert_close(mine.grad, whole.grad[4 * rank:4 * rank + 4], rtol=1e-4, atol=1e-5)
torch.testing.assert_close(synced.weight.grad, reference.weight.grad, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(synced.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(synced.running_var, reference.running_var, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(synced.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
print("rank", rank, "matches")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch(tmp_path):
    """Each of 2 gloo ranks normalizes half the batch; outputs' input gradients, parameter gradients (summed
    over ranks) and running statistics equal one nn.BatchNorm2d's on the whole batch."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("matches") == 2


def _clone(module):
    import copy

    return copy.deepcopy(module)


def test_sync_batch_norm_names_a_module_the_model_lacks(one_process_group):
    import torch
    from torch import nn

    from autoplan.errors import UserError
    from autoplan.runtime.distributed.batchnorm import sync_batch_norm

    class Mesh:  # the two data-parallel dims of a dp=2 mesh, as sync_batch_norm reads them
        device_type = "cpu"

        def __getitem__(self, name):
            return _Dim(2 if name == "dp_replicate" else 1, one_process_group)

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    synced = sync_batch_norm(model, Mesh(), ["1"])
    assert type(synced[1]).__name__ == "DataParallelBatchNorm" and synced[1].weight is model[1].weight
    assert synced(torch.randn(3, 2)).shape == (3, 2)
    with pytest.raises(UserError, match="runtime.batchnorm: the plan names '0' as a BatchNorm module, but the "
                                        "model's '0' is a Linear"):
        sync_batch_norm(model, Mesh(), ["0"])
    with pytest.raises(UserError, match="'blocks.0.bn1', which the model does not have"):
        sync_batch_norm(model, Mesh(), ["blocks.0.bn1"])


class _Dim:
    def __init__(self, size, group):
        self._size, self._group = size, group

    def size(self):
        return self._size

    def get_group(self):
        return self._group


def test_recomputing_a_batch_norm_model_is_refused():
    """torch.utils.checkpoint re-runs the forward: BatchNorm's running statistics would move twice."""
    scope = Scope(num_gpus=2, global_batch=8, batch_norm_modules=BN)
    found = problems(Layout(dp=2, recompute="full"), scope)
    assert found == ["recompute=full re-runs forwards in backward, and BatchNorm module 'stem.1' (and 1 more) would "
                     "update its running statistics twice per step (use recompute=none)"]
    assert problems(Layout(dp=2, recompute="none"), scope) == []


# planning, pricing and plan.json ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet_profile():
    from autoplan.api import ProfileOptions, profile_only

    return profile_only(str(RESNET), "h100-sxm5-80gb", ProfileOptions(measure=False))


def _search(profile, gpus: int, batch: int, pins=None):
    from autoplan.api import load_cluster
    from autoplan.layout import Layout
    from autoplan.plan import Training
    from autoplan.solve.search import search

    cluster = load_cluster(gpus, "h100-sxm5-80gb", None, None, None)
    return search(profile, cluster, Training(global_batch_size=batch, dtype="bf16"), pins or Layout())


def test_the_search_never_splits_a_batch_norm_model_into_micro_batches(resnet_profile):
    result = _search(resnet_profile, 8, 64)
    chosen = [result.best.parallelism] + [c.parallelism for c in result.candidates]
    assert all(p.microbatches == 1 for p in chosen)
    assert all(p.pp == 1 or p.dp == 1 for p in chosen)
    assert all(p.recompute == "none" for p in chosen)
    assert result.context.batch_norm_modules[0] == "stem.1"


def test_pinned_micro_batches_are_refused_naming_the_module(resnet_profile):
    from autoplan.errors import UserError
    from autoplan.solve.pins import parse_pins

    with pytest.raises(UserError, match=r"pins cannot hold: .*microbatch=2 = 4 micro-batches per data-parallel rank, "
                                        r"but BatchNorm module 'stem.1' \(and 14 more\) normalizes over the batch"):
        _search(resnet_profile, 8, 64, parse_pins("dp=8,microbatch=2"))
    with pytest.raises(UserError, match="recompute=selective re-runs forwards in backward, and BatchNorm module"):
        _search(resnet_profile, 8, 64, parse_pins("recompute=selective"))
    # dp left to the search: every family it could pick splits the batch, and the message says why
    with pytest.raises(UserError, match=r"no layout satisfies the pins 'pp=2,microbatch=1' on 2 GPUs at global "
                                        r"batch 4: .*= 4 micro-batches per data-parallel rank, but BatchNorm module "
                                        r"'stem.1'"):
        _search(resnet_profile, 2, 4, parse_pins("pp=2,microbatch=1"))


def test_sync_batch_norm_is_priced_per_call_and_data_parallel_rank(resnet_profile):
    from autoplan.cost import comm
    from autoplan.hardware.types import Link
    from autoplan.solve.pins import parse_pins

    link = Link("test", bus_bandwidth_bytes_per_s=1e9, latency_s=1e-5, source="test")
    one_call = comm.sync_batch_norm_s([16], comm.Group(2, link))
    expected = (2e-5 + (33 * 4 + 32 * 4) * 2 * 1 / 2 / 1e9)
    assert one_call == pytest.approx(expected)
    assert comm.sync_batch_norm_s([16, 16], comm.Group(2, link)) == pytest.approx(2 * expected)
    assert comm.sync_batch_norm_s([16], comm.Group(1, link)) == 0.0

    dp8 = _search(resnet_profile, 8, 64, parse_pins("dp=8")).best.predicted.time_breakdown
    assert dp8["batch_norm_sync"] > 15 * 2 * 1e-6  # 15 calls, two all-reduces each, microseconds of latency
    dp1 = _search(resnet_profile, 1, 8).best.predicted.time_breakdown
    assert "batch_norm_sync" not in dp1


def test_plan_json_lists_batch_norm_modules_and_old_plans_still_load():
    from autoplan.plan import (ClusterRef, ModelRef, Parallelism, Plan, PlanError, Prediction, SolverInfo, Stage,
                               Training)

    plan = Plan(model=ModelRef("model.py"), cluster=ClusterRef("cpu", 2, 2, 2.0**30),
                training=Training(global_batch_size=4),
                parallelism=Parallelism(dp_replicate=2, microbatch=2),
                stages=(Stage(0, ("stem.0", "stem.1"), 0.1, 100.0),), predicted=Prediction(0.5, 8.0, None, 1e9, 0.3, 100.0),
                solver=SolverInfo("highs", "optimal", 0.01, 3), batch_norm_modules=("stem.1",))
    raw = json.loads(plan.to_json())
    assert raw["batch_norm_modules"] == ["stem.1"]
    assert Plan.from_json(plan.to_json()) == plan
    del raw["batch_norm_modules"]  # a plan written before the field: no BatchNorm
    assert Plan.from_dict(raw).batch_norm_modules == ()
    split = json.loads(plan.to_json())
    split["parallelism"].update(pipeline_parallel_microbatch_size=1, pipeline_parallel_num_microbatches=2)
    with pytest.raises(PlanError, match="microbatches=2 micro-batches per data-parallel rank, but BatchNorm module "
                                        "'stem.1' normalizes"):
        Plan.from_dict(split)
    with pytest.raises(PlanError, match="batch_norm_modules must be a list of module names"):
        Plan.from_dict({**raw, "batch_norm_modules": "stem.1"})


# the generated program -------------------------------------------------------------------------------

@pytest.mark.slow
def test_resnet_dp2_matches_the_reference_losses_and_running_statistics(tmp_path):
    """autoplan verify passes at dp=2, and the buffers of the distributed run's final checkpoint (every
    BatchNorm's running_mean, running_var, num_batches_tracked) equal the single-device reference's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from autoplan.verify import VerifySettings, verify

    out, steps = tmp_path / "plan", 3
    subprocess.run([sys.executable, "-m", "autoplan.cli", str(RESNET), "--gpus", "2", "--gpu", "cpu",
                    "--global-batch", "8", "--out", str(out)], check=True, capture_output=True)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["parallelism"]["data_parallel_replicate_degree"] == 2
    assert plan["parallelism"]["pipeline_parallel_num_microbatches"] == 1 and len(plan["batch_norm_modules"]) == 15
    result = verify(out, VerifySettings(steps=steps))
    assert result.passed, result

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
                    "--device", "cpu", "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-every", "1"], cwd=out, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    # after one step the statistics come from the same initial weights: equal to float rounding; after
    # three, AdamW's normalized updates of near-zero gradients let the weights (so the statistics) drift
    for done, atol in ((1, 1e-6), (steps, 1e-4)):
        dcp_to_torch_save(tmp_path / "ckpt" / f"step_{done}", tmp_path / f"step_{done}.pt")
        trained = torch.load(tmp_path / f"step_{done}.pt", weights_only=True)["model"]
        buffers = dict(_reference_model(out, done).named_buffers())
        assert len(buffers) == 45  # 15 BatchNorms x (running_mean, running_var, num_batches_tracked)
        for name, expected in buffers.items():
            torch.testing.assert_close(trained[name], expected, rtol=1e-4, atol=atol,
                                       msg=lambda m, name=name: f"after {done} steps, {name}: {m}")
        assert int(trained["stem.1.num_batches_tracked"]) == done
        assert not torch.allclose(buffers["stem.1.running_var"], torch.ones(16))  # the statistics did move


@pytest.mark.slow
@pytest.mark.parametrize("pin, world", [("zero=3", 2), ("pp=2,schedule=gpipe", 2)])
def test_fsdp_and_pipeline_stages_keep_the_reference_running_statistics(tmp_path, pin, world):
    """FSDP2 with the synchronized BatchNorm, and a pipeline (dp=1, one micro-batch) whose exported stages
    run BatchNorm themselves: after one step every running statistic equals the reference's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "plan"
    subprocess.run([sys.executable, "-m", "autoplan.cli", str(RESNET), "--gpus", str(world), "--gpu", "cpu",
                    "--global-batch", "8", "--pin", pin, "--out", str(out)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    "train.py", "--device", "cpu", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt")],
                   cwd=out, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    dcp_to_torch_save(tmp_path / "ckpt" / "step_1", tmp_path / "step_1.pt")
    trained = torch.load(tmp_path / "step_1.pt", weights_only=True)["model"]
    by_name = {name.partition(".")[2] if name.startswith("stage") else name: t for name, t in trained.items()}
    buffers = dict(_reference_model(out, 1).named_buffers())
    for name, expected in buffers.items():
        torch.testing.assert_close(by_name[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.allclose(buffers["stem.1.running_var"], torch.ones(16))


def _reference_model(out: Path, steps: int):
    """autoplan verify's single-device reference of the generated train.py (runtime/harness/reference.py train_reference),
    keeping the model it trains."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("generated_train", out / "train.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    source = program.runtime.load_source(f"{program.MODEL_FILE}:{program.FACTORY}")
    built = []

    class Recording:
        def __getattr__(self, name):
            return getattr(source, name)

        def build_model(self):
            built.append(source.build_model())
            return built[-1]

    from autoplan.runtime.harness.reference import train_reference

    train_reference(program, Recording(), torch.device("cpu"), program.parse_args(["--steps", str(steps)]))
    return built[0]
