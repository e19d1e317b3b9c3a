"""The generated program's CUDA path, checked where a CPU can check it: the local GPU index DDP and every
per-GPU call need, the process group's timeout sized to rank 0's model build, and (under the `gpu` marker,
on a machine with CUDA) each step's own peak memory."""

import ast
import datetime

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from autoplan.codegen import render_train_py
from autoplan.codegen.launch import launch_layout
from autoplan.codegen.program import (BUILD_BYTES_PER_S, BUILD_TIME_MARGIN, MIN_PROCESS_GROUP_TIMEOUT_S,
                                      process_group_timeout_s)
from autoplan.errors import UserError
from autoplan.layout import Parallelism
from autoplan.runtime.distributed import mesh as mesh_module
from autoplan.runtime.distributed import parallel

from test_codegen import config_values, make_plan


def test_cuda_without_an_index_is_this_process_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mesh_module.local_device("cuda") == torch.device("cuda", 3)
    assert mesh_module.local_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert mesh_module.local_device("cpu") == torch.device("cpu")


class _Dim:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self):
        return "the dp_replicate group"


def test_ddp_gets_the_local_gpu_not_none(monkeypatch):
    """train.py passes torch.device("cuda") (no index): DDP must get [LOCAL_RANK], not [None]."""
    seen = {}

    class FakeDDP:
        def __init__(self, module, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    monkeypatch.setenv("LOCAL_RANK", "2")
    mesh = {"dp_shard": _Dim(1), "cp": _Dim(1), "dp_replicate": _Dim(4), "tp": _Dim(1)}
    parallel.replicate_data_parallel(torch.nn.Linear(2, 2), mesh, torch.device("cuda"))
    assert seen["device_ids"] == [2]
    parallel.replicate_data_parallel(torch.nn.Linear(2, 2), mesh, torch.device("cpu"))
    assert seen["device_ids"] is None


def test_process_group_starts_with_the_programs_timeout(monkeypatch):
    started = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: started.update(kwargs))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(UserError, match="but 2 are running"):  # stops at the world-size check, after starting
        mesh_module.device_mesh(torch.device("cpu"), Parallelism(dp_shard=3), timeout_s=4321.0)
    assert started == {"backend": "gloo", "timeout": datetime.timedelta(seconds=4321.0)}
    started.clear()
    with pytest.raises(UserError, match="but 2 are running"):
        mesh_module.device_mesh(torch.device("cpu"), Parallelism(dp_shard=3))
    assert started["timeout"] == datetime.timedelta(seconds=mesh_module.PROCESS_GROUP_TIMEOUT_S) > \
        datetime.timedelta(minutes=10)  # longer than torch's NCCL default


def test_timeout_is_sized_to_rank_0s_model_build():
    llama_70b = 70_553_706_496
    assert process_group_timeout_s(llama_70b) == round(BUILD_TIME_MARGIN * 4 * llama_70b / BUILD_BYTES_PER_S) == 5644
    assert process_group_timeout_s(1_235_814_400) == MIN_PROCESS_GROUP_TIMEOUT_S  # Llama-3.2-1B: the floor
    plan = make_plan()
    plan = replace(plan, model=replace(plan.model, param_count=llama_70b))
    values = config_values(render_train_py(plan, launch_layout(plan)))
    assert values["PROCESS_GROUP_TIMEOUT_S"] == 5644.0
    train_py = render_train_py(plan, launch_layout(plan))
    calls = [node for node in ast.walk(ast.parse(train_py)) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", None) == "init_mesh"]
    assert [k.arg for k in calls[0].keywords] == ["timeout_s"]


@pytest.mark.gpu
def test_each_steps_peak_is_its_own_on_cuda():
    """StepMetrics.record resets the allocator's peak after reading it: a later, smaller step does not report
    an earlier step's (or the materialization's) peak."""
    from autoplan.runtime.components.metrics import StepMetrics

    device = torch.device("cuda", torch.cuda.current_device())
    metrics = StepMetrics(global_batch=1, world_size=1, device=device)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    del big
    # a one-rank process group for the max over ranks
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        first = metrics.record(0, 1.0, 0.1)
        small = torch.empty(2**20, dtype=torch.uint8, device=device)
        second = metrics.record(1, 1.0, 0.1)
        del small
    finally:
        dist.destroy_process_group()
    assert first["peak_memory_bytes"] >= 256 * 2**20 > second["peak_memory_bytes"]
