"""autoplan: plan, profile and generate parallel training programs for unmodified PyTorch models.

    import autoplan
    result = autoplan.plan("examples/gpt.py", gpus=8, gpu="h100-sxm5-80gb")
    print(result.parallelism, result.predicted.step_time_s)
"""

from __future__ import annotations

from autoplan.errors import Infeasible, UserError
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, Plan

__version__ = "0.1.0"


def plan(model, gpus: int, gpu: str = "h100-sxm5-80gb", **options) -> Plan:
    """Plan `model` (path to model.py, "path.py:factory", or a factory with example_batch=) for `gpus`
    accelerators. Options mirror the CLI: gpus_per_node, global_batch, dtype, memory_per_gpu, pin,
    hardware, solver, time_limit, out (write the output folder)."""
    from autoplan.api import plan_model

    return plan_model(model, gpus, gpu, **options).plan


def estimate(model, gpus: int, pin: str, gpu: str = "h100-sxm5-80gb", **options) -> Plan:
    """The prediction for exactly the pinned layout (e.g. pin="dp=2,pp=2")."""
    return plan(model, gpus, gpu, pin=pin, **options)


def profile(model, gpu: str = "cpu", **options):
    """Capture and profile a model; returns a ModelProfile (ops with FLOPs, bytes and times)."""
    from autoplan.api import profile_only

    return profile_only(model, gpu, **options)


__all__ = ["plan", "estimate", "profile", "Plan", "Parallelism", "Cluster", "UserError", "Infeasible"]
