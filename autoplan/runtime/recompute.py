"""Activation checkpointing of the plan's chain modules: recompute activations in backward instead of
keeping them.

  "full"       keep only each chain module's inputs; rerun the whole chain module in backward.
  "selective"  keep the outputs of matmuls and attention (the expensive ops) and recompute the
               rest (norms, activations, elementwise): op-level selective checkpointing as in
               torchtitan, with torch.utils.checkpoint.create_selective_checkpoint_contexts.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Sequence

import torch
from torch import nn

from autoplan.errors import UserError
from autoplan.runtime.dropout import recompute_context

ROOT_MODULE = ""
"""The chain module name of the root module (a model whose root runs every op itself is one chain module)."""
MODES = ("none", "selective", "full")
_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)


def saved_ops() -> set:
    """The aten ops whose outputs "selective" keeps (those this torch build has)."""
    return {getattr(torch.ops.aten, name).default for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)}


def _save_matmuls(saved: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """Context pair for torch.utils.checkpoint (context_fn): save matmul/attention outputs only."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_save_matmuls, saved_ops()))


@contextmanager
def _both(first, second):
    with first, second:
        yield


def _contexts(selective: bool):
    """torch.utils.checkpoint's context_fn: the forward and recomputation contexts ("selective": what to
    save), the recomputation also with dropout off while runtime.NoDropout is active (runtime/dropout.py)."""
    forward, recompute = selective_context() if selective else (nullcontext(), nullcontext())
    return forward, _both(recompute, recompute_context())


def checkpoint_modules(module: nn.Module, chain_modules: Sequence[str], mode: str) -> nn.Module:
    """Wrap each chain module (a submodule path; "" = the module itself) for recomputation. Returns the
    module, wrapped itself if it is a chain module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in MODES:
        raise UserError(f"activation_checkpoint must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return module
    kwargs = {"context_fn": partial(_contexts, mode == "selective")}
    for path in chain_modules:
        if path == ROOT_MODULE:
            return checkpoint_wrapper(module, **kwargs)
        parent_path, _, leaf = path.rpartition(".")
        setattr(submodule(module, parent_path), leaf, checkpoint_wrapper(submodule(module, path), **kwargs))
    return module


def submodule(module: nn.Module, path: str) -> nn.Module:
    """module.get_submodule(path), with a UserError naming the plan's module if it is missing."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        raise UserError(f"the plan names module {path!r}, which the model does not have") from None
