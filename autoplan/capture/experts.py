"""The experts module of a mixture of experts, as transformers' MoE families (Mixtral, Qwen2-MoE, OLMoE, ...)
write it: called after the router as `experts(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))`,
its parameters stacked per expert on dimension 0 and its `num_experts` saying how many. The one place the
rule lives: the runtime shards such modules (runtime/distributed/expert_parallel.py) and the profile counts the tokens
the router sends them (profile/router_loads.py)."""

from __future__ import annotations

from torch import nn


def is_experts_module(module: nn.Module) -> bool:
    """`num_experts`, and parameters stacked per expert on dimension 0, weight matrices among them (a router's
    (E, H) weight is not stacked matrices)."""
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (isinstance(experts, int) and any(p.dim() == 3 for p in params)
            and all(p.dim() >= 2 and p.shape[0] == experts for p in params))
