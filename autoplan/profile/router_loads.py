"""How many (token, slot) rows the router sends each expert, counted on the real model (profile --measure).

Expert parallelism puts E/ep experts on each rank, so the busiest rank waits on its experts' rows: the
cost model multiplies the experts' compute by the busiest rank's share over the mean
(cost/expert_parallel.py). Without a measurement that ratio is the spread of uniform random routing; with
one, it is the measured rows grouped as the ranks hold the experts. The model is built for real, on CPU,
with its own initial weights, and runs the profile's example batch forward once: the counts are those of a
freshly initialised router (a trained one is usually more skewed), on that batch's tokens.
"""

from __future__ import annotations

import torch

from autoplan.capture.experts import is_experts_module
from autoplan.profile.whole_model import MAX_PARAMETER_BYTES
from autoplan.contract import ModelSource, call_model, call_user


def measure_router_loads(source: ModelSource, batch_size: int, parameter_bytes: float) -> dict[str, tuple[int, ...]]:
    """Experts module FQN -> rows routed to each of its experts, for one forward of example_batch(batch_size);
    empty for a model without experts modules or too large to build here (whole_model.MAX_PARAMETER_BYTES)."""
    if parameter_bytes > MAX_PARAMETER_BYTES:
        return {}
    torch.manual_seed(0)
    model = call_user(source, "build_model()", source.build_model)
    experts = {name: module for name, module in model.named_modules() if is_experts_module(module)}
    if not experts:
        return {}
    counts = {name: torch.zeros(module.num_experts, dtype=torch.long) for name, module in experts.items()}

    def counter(name: str):
        def hook(module, args, kwargs):
            top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts[name] += torch.bincount(top_k_index.reshape(-1).long().cpu(), minlength=module.num_experts)
        return hook

    handles = [module.register_forward_pre_hook(counter(name), with_kwargs=True) for name, module in experts.items()]
    try:
        inputs, _ = call_user(source, f"example_batch({batch_size})", source.example_batch, batch_size)
        with torch.no_grad():
            call_user(source, "the model's forward", call_model, model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: tuple(int(c) for c in count) for name, count in counts.items()}
