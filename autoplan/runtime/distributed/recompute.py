"""Activation checkpointing of the plan's chain modules: recompute activations in backward instead of
keeping them.

  "full"       keep only each chain module's inputs; rerun the whole chain module in backward.
  "selective"  keep the outputs of matmuls, attention and the experts' all-to-alls (the expensive ops)
               and recompute the rest (norms, activations, elementwise): op-level selective checkpointing
               as in torchtitan, with torch.utils.checkpoint.create_selective_checkpoint_contexts.

Under torch.compile (the plan's compile=on compiles the checkpointed chain modules) dynamo turns each
checkpoint into a higher-order op: torch then accepts only TorchDispatchModes from context_fn
(_compiled_context), and traces the checkpointed function with the torch-function modes active outside it
popped, so runtime/distributed/dropout.py NoDropout's mode does not reach it: the function enters that mode itself
(_run_without_dropout), as the eager recomputation does (recompute_context).

Selective checkpointing replays each op by its invocation count, so an op that runs a different number of times in
the recomputation than in the forward breaks it ("invocation index N ... not found in storage"). FSDP2's hooks
open profiler annotations (`record_function`) that do: an experts module that is its own FSDP2 unit inside a
checkpointed block (folded expert parallelism) annotates its post-forward once more in the recomputation.
Annotations compute nothing, so they run outside the checkpoint's bookkeeping (_PassAnnotations), as PyTorch's own
fix does in later releases (SAC ignores profiler record-function ops).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from autoplan.errors import UserError
from autoplan.runtime.distributed.dropout import recompute_context

ROOT_MODULE = ""
"""The chain module name of the root module (a model whose root runs every op itself is one chain module)."""
MODES = ("none", "selective", "full")
_SAVED_OP_NAMES = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)


_SAVED_COLLECTIVE_NAMES = ("all_to_all_single",)
"""Functional collectives whose outputs "selective" keeps: the expert-parallel route's all-to-alls
(runtime/distributed/expert_parallel.py _route), as torchtitan's op-level save list keeps
torch.ops._c10d_functional.all_to_all_single (torchtitan/models/deepseek_v3/infra/parallelize.py
_op_sac_save_list), so the recomputation does not exchange the rows again. all_to_all_single_autograd
dispatches this op below autograd, where the checkpoint's policy sees it."""


def saved_ops() -> set:
    """The ops whose outputs "selective" keeps (those this torch build has)."""
    aten = {getattr(torch.ops.aten, name).default for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    return aten | {getattr(functional, name).default for name in _SAVED_COLLECTIVE_NAMES
                   if functional is not None and hasattr(functional, name)}


def _save_matmuls(saved: set, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """Context pair for torch.utils.checkpoint (context_fn): save matmul/attention outputs only."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_save_matmuls, saved_ops()))


def _compiled_context(selective: bool):
    """The context pair under torch.compile, where torch accepts only a pair of TorchDispatchModes: the
    selective policy, or "recompute every op" for full (what torch itself runs for a checkpoint without a
    context_fn under compile). Dropout is _run_without_dropout's: the recomputation is part of the compiled graph,
    traced from the forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_save_matmuls, saved_ops()) if selective else _recompute_all)


@contextmanager
def _both(first, second):
    with first, second:
        yield


ANNOTATION_NAMESPACES = ("profiler",)
"""The op namespaces that only annotate (record_function's enter and exit): never computed, never replayed."""


class _PassAnnotations(TorchDispatchMode):
    """Entered inside a selective checkpoint's modes: runs annotation ops with every dispatch mode off, so the
    checkpoint neither stores nor counts them; every other op goes on to the checkpoint's mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ANNOTATION_NAMESPACES:
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def traced() -> bool:
    """Whether torch.utils.checkpoint takes this call for a traced one, where it accepts only a pair of
    TorchDispatchModes as contexts: while dynamo traces, and while AOTAutograd (or make_fx) traces, which torch
    tells by a proxy dispatch mode being active (utils/checkpoint.py, _is_compiling). The second is not the
    first: inductor traces the checkpoint's higher-order op with AOTAutograd after dynamo has finished, where
    torch 2.11's torch.compiler.is_compiling() is false (seen on an H200 with torch 2.11: the compiled selective
    plan failed at step 0)."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _contexts(selective: bool):
    """torch.utils.checkpoint's context_fn: the forward and recomputation contexts ("selective": what to
    save). Eager (and a region dynamo leaves to eager at a graph break), the recomputation runs with dropout off
    while a runtime/distributed/dropout.py NoDropout is active; while torch.compile traces the checkpoint (traced()),
    _compiled_context."""
    if traced():
        return _compiled_context(selective)
    if not selective:
        return nullcontext(), recompute_context()
    forward, recompute = selective_context()
    return _both(forward, _PassAnnotations()), _both(_both(recompute, _PassAnnotations()), recompute_context())


def _run_without_dropout(module: nn.Module, *args, **kwargs):
    """The checkpointed function: `module`'s forward. While torch.compile traces it, NoDropout's mode (when one
    is active) is entered here, inside the checkpoint, where dynamo traces it into the graph (the recomputation
    in backward is part of that graph). Eager, NoDropout's own mode covers the forward and recompute_context
    the recomputation."""
    if torch.compiler.is_compiling():
        with recompute_context():
            return module(*args, **kwargs)
    return module(*args, **kwargs)


def _checkpoint(module: nn.Module, *args, context_fn, **kwargs):
    """checkpoint_wrapper's checkpoint_fn: torch.utils.checkpoint of _run_without_dropout (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_run_without_dropout, module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def allow_mode_in_compiled_checkpoint() -> None:
    """Let dynamo trace _run_without_dropout's entering of NoDropout's mode inside a checkpoint: torch 2.13 calls
    a change of the torch-function mode stack there a side effect that backward's recomputation would not
    replay, and leaves the whole checkpointed module to eager at a graph break ("HOP: Unsafe side effect"). Under
    compile the recomputation is traced from the same graph, mode included, so nothing is lost; a model's own
    Python side effects in a compiled checkpointed forward then run once, as without recomputation."""
    import torch._dynamo.config

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def checkpoint_modules(module: nn.Module, chain_modules: Sequence[str], mode: str) -> nn.Module:
    """Wrap each chain module (a submodule path; "" = the module itself) for recomputation. Returns the
    module, wrapped itself if it is a chain module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode not in MODES:
        raise UserError(f"activation_checkpoint must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return module
    kwargs = {"checkpoint_fn": _checkpoint, "context_fn": partial(_contexts, mode == "selective")}
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
