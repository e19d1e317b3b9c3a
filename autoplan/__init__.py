"""autoplan: plan, profile and generate parallel training programs for unmodified PyTorch models.

    import autoplan
    result = autoplan.plan("examples/gpt.py", gpus=8, gpu="h100-sxm5-80gb")
    print(result.parallelism, result.predicted.step_time_s)

A plan in your own training loop (under torchrun; docs/own-loop.md):

    parallel = autoplan.parallelize(model, autoplan.load_plan("autoplan_out/plan.json"))
    optimizer = torch.optim.AdamW(parallel.parameters())

`import autoplan` stays light: torch is imported by the functions that need it, when called.
"""

from __future__ import annotations

from autoplan import plan, profile  # the module plan.py and the package profile/, callable as the functions below
from autoplan.errors import Infeasible, UserError
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, Plan, load_plan
from autoplan.public import callable_module

__version__ = "0.1.0"


def _plan(model, gpus: int, gpu: str = "h100-sxm5-80gb", **options) -> Plan:
    """autoplan.plan(model, gpus, gpu, **options): plan `model` (path to model.py, "path.py:factory", or a factory
    with example_batch=) for `gpus` accelerators. Options mirror the CLI (autoplan.api.PlanOptions): gpus_per_node,
    global_batch, dtype, memory_per_gpu, host_memory_per_node, pin, hardware, solver, time_limit, measure, out (write
    the output folder)."""
    from autoplan.api import PlanOptions, plan_model

    return plan_model(model, gpus, gpu, PlanOptions(**options)).plan


def estimate(model, gpus: int, pin: str, gpu: str = "h100-sxm5-80gb", **options) -> Plan:
    """The prediction for exactly the pinned layout (e.g. pin="dp=2,pp=2")."""
    return _plan(model, gpus, gpu, pin=pin, **options)


def _profile(model, gpu: str = "cpu", **options):
    """autoplan.profile(model, gpu, **options): capture and profile a model; returns a ModelProfile (ops with FLOPs,
    bytes and times). Options: autoplan.api.ProfileOptions (hardware, measure, batch_size, dtype, out)."""
    from autoplan.api import ProfileOptions, profile_only

    return profile_only(model, gpu, ProfileOptions(**options))


callable_module(plan, _plan)
callable_module(profile, _profile)


def init_mesh(plan, device=None, timeout_s=None):
    """The plan's torch DeviceMesh, dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"), over the processes torchrun
    started (it starts the process group, NCCL on CUDA or gloo on CPU, unless one is running; its collectives time
    out after `timeout_s` seconds, default 30 minutes). `plan`: a Plan, the path of a plan.json or of an output
    folder. A UserError if the number of processes is not the plan's."""
    from autoplan.runtime.apply_plan import init_plan_mesh

    return init_plan_mesh(plan, device, timeout_s)


def parallelize(model, plan, mesh=None, *, device=None, example_inputs=None, loss_fn=None, initial_values=None):
    """Apply `plan` to `model` on this rank, in the order the generated train.py does (it calls this):
    pipeline stages, then tensor parallel, recompute, compile, FSDP2/HSDP, the initial values (rank 0's), DDP.
    Returns an autoplan.Parallelized: .parts (this rank's modules), .param_groups() for the optimizer,
    .shard_batch(inputs, targets) for this rank's slice of a global batch, .forward_backward(inputs, targets)
    (the local loss), .global_loss(local_loss), .mesh, .rank. Arguments: autoplan.runtime.apply_plan.parallelize."""
    from autoplan.runtime.apply_plan import parallelize as apply

    return apply(model, plan, mesh, device=device, example_inputs=example_inputs, loss_fn=loss_fn,
                 initial_values=initial_values)


def model_copy(plan):
    """The path of the copy of the model file an output folder holds (model_code/, made at planning; the file
    the generated train.py runs). `plan`: the output folder or its plan.json."""
    from pathlib import Path

    from autoplan.codegen.program import find_model_copy

    folder = Path(plan) if Path(plan).is_dir() else Path(plan).parent
    return find_model_copy(folder, load_plan(plan).model.path)


_LAZY = {"Parallelized": "autoplan.runtime.apply_plan", "ParallelConfig": "autoplan.runtime.distributed.config"}
"""Public names whose modules import torch: imported on first use."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")


__all__ = ["plan", "estimate", "profile", "parallelize", "init_mesh", "load_plan", "model_copy", "Plan", "Parallelism", "Parallelized",
           "ParallelConfig", "Cluster", "UserError", "Infeasible"]
