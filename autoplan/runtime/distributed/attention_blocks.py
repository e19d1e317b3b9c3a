"""Which modules context parallelism feeds sequence shards: found by running the model once on fake tensors.

Under context parallelism every module from the block of the first `scaled_dot_product_attention` call on (the
transformer blocks, then norm and head) computes on the rank's share of each sequence, and what runs before it
(embeddings, positions, rotary tables, masks) on the whole sequence, so an unmodified model keeps its positions
right (runtime/distributed/context_parallel.py, shard_block_inputs). The plan names the chain modules, not which of them
attend nor where a block starts (its chain may be finer: blocks.0.ln_1, blocks.0.attn, ...):
`find_attention_blocks` runs the model's forward on fake tensors (FakeTensorMode over the meta-device model: no
memory, no values) with hooks noting which modules run and a TorchFunctionMode noting the modules running when
F.scaled_dot_product_attention is called, and with which is_causal.

transformers treats a fake tensor as tracing and then passes its causal mask as a tensor (attn_mask) instead of
is_causal=True, as it does under torch.export; at run time, untraced, it passes is_causal. A masked call is
therefore taken as causal here: a mask that is really there at run time is refused by the ring anyway
(context_parallel._refuse_mask), and torch refuses load balancing for a call that is not causal.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autoplan.contract import call_model
from autoplan.errors import UserError
from autoplan.runtime.distributed.recompute import ROOT_MODULE, submodule

QUERY_SEQUENCE_DIM = -2
"""The sequence dimension of SDPA's query, (..., sequence, head_dim)."""


@dataclass(frozen=True)
class AttentionBlocks:
    """The modules whose inputs context parallelism shards, and how their attention masks."""

    modules: tuple[str, ...]
    """`first`, then every chain module that starts after it, in call order: their hooks hand each its share of
    every whole-sequence input (the hidden states at `first`, the rotary cos/sin at every block)."""
    first: str
    """The block of the first attention call: of the modules running it, the outermost that started after a
    chain module had run (the embeddings), so that the residual stream enters it whole and stays sharded from
    there (a chain finer than the blocks, e.g. blocks.0.attn, would leave the block's own residual add whole)."""
    causal: bool
    """Every attention call is causal (is_causal, or the mask transformers builds under tracing): torch's ring
    balances the causal triangle over the ranks (_cp_options.enable_load_balance); else none is, and it does not."""
    sequence_length: int
    """Tokens per sequence the attention sees on the example inputs (the query's dimension -2)."""


@dataclass(frozen=True)
class _Running:
    path: str
    """A module running (its FQN)."""
    entered: int
    """Its place in the order modules started in."""
    after_chain: bool
    """A chain module had returned before it started."""


@dataclass(frozen=True)
class _Call:
    running: tuple[_Running, ...]
    """The modules running when attention was called, outermost first."""
    causal: bool
    sequence_length: int


class _AttentionSpy(TorchFunctionMode):
    """Notes the modules starting and returning, and each F.scaled_dot_product_attention call with the modules
    running it."""

    def __init__(self, chain: Sequence[str]) -> None:
        super().__init__()
        self.chain = set(chain)
        self.running: list[_Running] = []
        self.started: list[str] = []
        """Every module that started, in order."""
        self.chain_returned = False
        self.calls: list[_Call] = []

    def entering(self, path: str):
        """A forward pre-hook noting that module `path` starts."""
        def hook(module: nn.Module, args: Any) -> None:
            self.running.append(_Running(path, len(self.started), self.chain_returned))
            self.started.append(path)
        return hook

    def leaving(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward hook noting that the innermost running module returned."""
        done = self.running.pop()
        self.chain_returned = self.chain_returned or done.path in self.chain

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            self.calls.append(_Call(tuple(self.running), bool(causal) or mask is not None,
                                    int(args[0].shape[QUERY_SEQUENCE_DIM])))
        return func(*args, **kwargs)


def find_attention_blocks(model: nn.Module, chain_modules: Sequence[str], example_inputs: Any,
                          device: torch.device | str = "meta") -> AttentionBlocks:
    """The AttentionBlocks of `model` (its parameters on the meta device, as parallelize holds it before filling
    in the values) on `example_inputs` (one micro-batch), run on fake tensors of `device` (so code that branches on
    the device type takes the branch the run will: transformers' MoE experts pick grouped matmuls by it). A
    UserError when the model calls no attention, or calls it before any chain module has returned (nothing computes
    the positions on the whole sequence first)."""
    from autoplan.runtime.distributed.split import fake_on_device

    chain = [u for u in chain_modules if u != ROOT_MODULE]
    for path in chain:
        submodule(model, path)  # a UserError naming a module the model does not have
    spy, handles, seen = _AttentionSpy(chain), [], set()
    for path, module in model.named_modules():
        if id(module) not in seen:
            seen.add(id(module))
            handles.append(module.register_forward_pre_hook(spy.entering(path)))
            handles.append(module.register_forward_hook(spy.leaving, always_call=True))
    try:
        with fake_on_device(model, torch.device(device)) as fakes, _experts_skipped(model):
            inputs = fakes.inputs(example_inputs)
            with fakes.mode, torch.device(device), spy, torch.no_grad():
                call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return _blocks(spy, type(model).__name__)


@contextmanager
def _experts_skipped(model: nn.Module):
    """Within: every experts module (capture/experts.py) returns zeros shaped like its hidden states instead of
    computing. Which modules call attention does not depend on the experts' values, and on fake tensors their kernels
    may refuse what the real ones take (transformers runs fp32 experts on CPU with torch._grouped_mm, whose meta
    kernel demands bf16)."""
    from autoplan.capture.experts import is_experts_module

    experts = {module: module.__dict__.get("forward") for module in model.modules() if is_experts_module(module)}
    for module in experts:
        module.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
    try:
        yield
    finally:
        for module, own in experts.items():
            if own is None:
                del module.forward
            else:
                module.forward = own


def _blocks(spy: _AttentionSpy, model_name: str) -> AttentionBlocks:
    calls = spy.calls
    if not calls:
        raise UserError(f"context parallelism splits attention's sequence, but this {model_name} calls no "
                        f"torch.nn.functional.scaled_dot_product_attention on the example inputs (use cp=1)")
    block = next((r for r in calls[0].running if r.after_chain), None)
    if block is None:
        raise UserError(f"context parallelism hands each rank its share of the sequence from the block of the first "
                        f"scaled_dot_product_attention call on, but this {model_name} calls it before any of its "
                        f"{len(spy.chain)} chain modules has returned, so nothing (embeddings, positions) would see "
                        f"the whole sequence (use cp=1)")
    causal = {c.causal for c in calls}
    if len(causal) > 1:
        raise UserError(f"context parallelism: {sum(c.causal for c in calls)} of this {model_name}'s "
                        f"{len(calls)} attention calls are causal and the others not; torch's ring balances "
                        f"the causal triangle for all calls or none (use cp=1)")
    later = [u for u in dict.fromkeys(spy.started[block.entered + 1:]) if u in spy.chain and u != block.path]
    return AttentionBlocks(modules=(block.path, *later), first=block.path, causal=causal.pop(),
                           sequence_length=max(c.sequence_length for c in calls))
