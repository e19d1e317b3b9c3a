"""Which chain modules context parallelism feeds sequence shards: found by running the model once on fake tensors.

Under context parallelism every module from the first one that calls `scaled_dot_product_attention` on (the
transformer blocks, then norm and head) computes on the rank's share of each sequence, and what runs before it
(embeddings, positions, rotary tables, masks) on the whole sequence, so an unmodified model keeps its positions
right (runtime/context_parallel.py, shard_block_inputs). The plan names the chain modules, not which of them
attend: `find_attention_blocks` runs the model's forward on fake tensors (FakeTensorMode over the meta-device
model: no memory, no values) with a TorchFunctionMode that notes which chain module is running when
F.scaled_dot_product_attention is called, and with which is_causal.

transformers treats a fake tensor as tracing and then passes its causal mask as a tensor (attn_mask) instead of
is_causal=True, as it does under torch.export; at run time, untraced, it passes is_causal. A masked call is
therefore taken as causal here: a mask that is really there at run time is refused by the ring anyway
(context_parallel._refuse_mask), and torch refuses load balancing for a call that is not causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autoplan.contract import call_model
from autoplan.errors import UserError
from autoplan.runtime.recompute import ROOT_MODULE, submodule

QUERY_SEQUENCE_DIM = -2
"""The sequence dimension of SDPA's query, (..., sequence, head_dim)."""


@dataclass(frozen=True)
class AttentionBlocks:
    """The chain modules whose inputs context parallelism shards, and how their attention masks."""

    modules: tuple[str, ...]
    """Every chain module from the first that calls scaled_dot_product_attention on, in the plan's order."""
    first: str
    """The first chain module that calls scaled_dot_product_attention."""
    causal: bool
    """Every attention call is causal (is_causal, or the mask transformers builds under tracing): torch's ring
    balances the causal triangle over the ranks (_cp_options.enable_load_balance); else none is, and it does not."""
    sequence_length: int
    """Tokens per sequence the attention sees on the example inputs (the query's dimension -2)."""


@dataclass(frozen=True)
class _Call:
    module: str
    """The innermost chain module running when attention was called ("" when none was)."""
    causal: bool
    sequence_length: int


class _AttentionSpy(TorchFunctionMode):
    """Notes each F.scaled_dot_product_attention call and the chain module running it."""

    def __init__(self) -> None:
        super().__init__()
        self.running: list[str] = []
        """The chain modules whose forward is running, outermost first."""
        self.calls: list[_Call] = []

    def entering(self, path: str):
        """A forward pre-hook noting that chain module `path` runs."""
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(path)
        return hook

    def leaving(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward hook noting that the innermost running chain module returned."""
        self.running.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            self.calls.append(_Call(self.running[-1] if self.running else "", bool(causal) or mask is not None,
                                    int(args[0].shape[QUERY_SEQUENCE_DIM])))
        return func(*args, **kwargs)


def find_attention_blocks(model: nn.Module, chain_modules: Sequence[str], example_inputs: Any) -> AttentionBlocks:
    """The AttentionBlocks of `model` (its parameters on the meta device, as parallelize holds it before filling
    in the values) on `example_inputs` (one micro-batch; moved to fake meta tensors). A UserError when the model
    calls no attention, or calls it outside its chain modules or in its first one (whose inputs are the model's
    own: token ids, before the positions are computed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    chain = [u for u in chain_modules if u != ROOT_MODULE]
    spy, handles = _AttentionSpy(), []
    for path in chain:
        module = submodule(model, path)
        handles.append(module.register_forward_pre_hook(spy.entering(path)))
        handles.append(module.register_forward_hook(spy.leaving, always_call=True))
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the meta parameters join as fake tensors
    try:
        inputs = pytree.tree_map(lambda t: fake.from_tensor(t.to("meta")) if isinstance(t, torch.Tensor) else t,
                                 example_inputs)
        with fake, spy, torch.no_grad():
            call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return _blocks(spy.calls, chain, type(model).__name__)


def _blocks(calls: list[_Call], chain: list[str], model_name: str) -> AttentionBlocks:
    if not calls:
        raise UserError(f"context parallelism splits attention's sequence, but this {model_name} calls no "
                        f"torch.nn.functional.scaled_dot_product_attention on the example inputs (use cp=1)")
    outside = next((c for c in calls if not c.module), None)
    if outside is not None:
        raise UserError(f"context parallelism shards the inputs of the chain modules from the first that calls "
                        f"scaled_dot_product_attention on, but this {model_name} calls it outside its "
                        f"{len(chain)} chain modules (use cp=1)")
    first = calls[0].module
    if chain.index(first) == 0:
        raise UserError(f"context parallelism shards the inputs of the chain modules from the first that calls "
                        f"scaled_dot_product_attention on, and that is '{first}', the first chain module, whose "
                        f"inputs are the model's own (embeddings and positions must see the whole sequence; "
                        f"use cp=1)")
    causal = {c.causal for c in calls}
    if len(causal) > 1:
        raise UserError(f"context parallelism: {sum(c.causal for c in calls)} of this {model_name}'s "
                        f"{len(calls)} attention calls are causal and the others not; torch's ring balances "
                        f"the causal triangle for all calls or none (use cp=1)")
    return AttentionBlocks(modules=tuple(chain[chain.index(first):]), first=first, causal=causal.pop(),
                           sequence_length=max(c.sequence_length for c in calls))
