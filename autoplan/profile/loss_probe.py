"""Can the model's loss_fn run on logits sharded on the vocabulary (torch's loss_parallel)?

With a vocabulary-parallel head the logits leave each tensor-parallel rank sharded on their last dimension, and
torch.distributed.tensor.parallel.loss_parallel computes the cross-entropy on the shards: it has handlers for
log-softmax and the NLL loss only. Any other op a loss_fn applies to the logits (label smoothing written by
hand, a z-loss's logsumexp, soft targets) has no such rule. The planner then gathers the logits first
(plan.json disable_loss_parallel) and says why.

The probe runs the model (each run of identical blocks cut to its first few, as the capture traces it) and its
loss_fn on the meta device (no memory, no FLOPs) and follows every tensor computed from the logits (the floating-point output with the largest last dimension) up to the NLL loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.errors import UserError

aten = torch.ops.aten

LOSS_PARALLEL_OPS = frozenset({
    aten._log_softmax.default, aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
})
"""The ops loss_parallel computes on sharded logits (its custom handlers, forward side)."""
LOSS_PARALLEL_STOPS = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default})
"""Their outputs no longer carry the vocabulary dimension: what follows (the mean, a scale) is free."""
SHAPE_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor, aten.select.int,
    aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.t.default, aten.squeeze.dim, aten.unsqueeze.default, aten.expand.default, aten.copy_.default,
    aten.lift_fresh.default, aten._log_softmax.default,
})
"""Ops DTensor runs on the logits keeping the vocabulary dimension sharded (views, casts, copies)."""
PROBE_FAILURES = (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError, IndexError,
                  UserError)
"""What a model or loss_fn may raise on the meta device: the probe then cannot tell (loss parallel stays on,
and the program's own fallback, runtime.ParallelLoss, still gathers the logits if it has to)."""


class _Follow(TorchDispatchMode):
    """Marks every tensor computed from a followed one; records the first op outside the allowed ones."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.followed = {id(logits)}
        self.keep = [logits]  # ids stay unique while the tensors live
        self.problem = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        touches = any(isinstance(t, torch.Tensor) and id(t) in self.followed
                      for t in pytree.tree_leaves((args, kwargs)))
        if not touches:
            return out
        if func not in SHAPE_OPS | LOSS_PARALLEL_OPS and not self.problem:
            self.problem = str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)
        if func not in LOSS_PARALLEL_STOPS:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.followed.add(id(t))
                    self.keep.append(t)
        return out


def _logits(output: Any) -> torch.Tensor | None:
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.ndim >= 2]
    return max(tensors, key=lambda t: t.shape[-1], default=None)


def sequence_targets_problem(source, batch_size: int) -> str:
    """"" when a target tensor has the inputs' sequence along dimension 1 (context parallelism cuts the targets
    to each rank's share of the sequence, as it cuts the activations); else why not, as one clause. "" too when
    the example batch has no sequence-long input (nothing to say) or cannot be made."""
    try:
        inputs, targets = source.example_batch(batch_size)
    except PROBE_FAILURES:
        return ""
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 1]
    if not tensors:
        return ""
    seq = max(t.shape[1] for t in tensors)
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if any(len(shape) > 1 and shape[1] == seq for shape in shapes):
        return ""
    return (f"the targets have no dimension of the sequence's {seq} tokens at position 1 (shapes {shapes}): "
            f"the loss cannot run on each rank's share of the sequence")


def loss_parallel_problem(source, batch_size: int) -> str:
    """"" when the loss_fn runs on the logits with the ops loss_parallel handles only (or the probe cannot
    tell); else which op it applies to them, as one clause."""
    from autoplan.capture.fake_model import initializers_skipped
    from autoplan.contract import call_model, compute_loss

    def on_meta(value):
        return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)

    try:
        with torch.device("meta"), initializers_skipped():
            model = source.build_model()
        inputs, targets = on_meta(source.example_batch(batch_size))
        with torch.no_grad():
            output = _output_cut_short(model, inputs, call_model)
        logits = _logits(output)
        if logits is None:
            return ""
        with _Follow(logits) as follow:
            compute_loss(source.loss_fn, output, targets)
    except PROBE_FAILURES:
        return ""
    if not follow.problem:
        return ""
    return (f"loss_fn applies aten.{follow.problem} to the logits, which torch's loss_parallel cannot compute on "
            "logits sharded on the vocabulary")


def _output_cut_short(model: torch.nn.Module, inputs: Any, call_model) -> Any:
    """The model's output on the meta device with each run of identical blocks cut to its first few, as the
    capture traces them (capture/repeats.py): identical blocks keep the hidden states' shape, so the output and
    its logits are the same, for a fraction of a deep model's ops; the whole model when the cut one fails."""
    from autoplan.capture.repeats import find_runs, truncated

    runs = find_runs(model)
    if runs:
        try:
            with truncated(model, runs):
                return call_model(model, inputs)
        except PROBE_FAILURES:
            pass
    return call_model(model, inputs)
