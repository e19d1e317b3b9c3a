"""The model contract at run time: how a model is called on a batch's inputs, and the loss it trains
with. One home for what planning (profile/whole_model.py times the model) and the generated program
(autoplan.runtime) both run, below both.

Inputs from example_batch are a Tensor (one positional argument), a tuple/list (positional
arguments) or a dict (keyword arguments).

A model file may define loss_fn(output, targets); without one, the default below applies: take
`.logits` from Hugging Face-style outputs, cross-entropy over the last dimension for integer targets,
mean squared error otherwise. Both are means over the batch, so the mean of equal-sized micro-batch
losses equals the loss of the whole batch (what gradient accumulation and pipelining rely on).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn import functional as F

from autoplan.errors import UserError

LossFn = Callable[[Any, Any], torch.Tensor]


def model_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) for calling the model on `inputs`."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    args, kwargs = model_args(inputs)
    return model(*args, **kwargs)


def model_logits(output: Any) -> torch.Tensor:
    """The prediction tensor of a model output: `.logits` (attribute or key), the first element of a
    tuple/list, or the output itself."""
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output:
        return model_logits(output[0])
    if not isinstance(output, torch.Tensor):
        raise UserError(f"the default loss cannot find the prediction in a model output of type "
                        f"{type(output).__name__}: define loss_fn(output, targets) in the model file")
    return output


def default_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (class ids or tokens), mean squared error otherwise."""
    logits = model_logits(output)
    if not targets.is_floating_point() and not targets.is_complex():
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return F.mse_loss(logits, targets)


def compute_loss(loss_fn: LossFn | None, output: Any, targets: Any) -> torch.Tensor:
    """The user's loss_fn if the model file defines one, else default_loss."""
    return (loss_fn or default_loss)(output, targets)
