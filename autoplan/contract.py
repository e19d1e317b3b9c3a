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

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

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


CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
"""Leaves of a model's inputs or outputs that torch.export records as constants (a forward returning (logits, None),
use_cache=True in a batch): a pipeline carries them, it never sends them."""


def disable_kv_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face models return a KV cache by default; training (and export) wants none: the model's config
    says so from now on, and the keyword arguments returned (a copy of `kwargs`) pass use_cache=False where
    the batch passed use_cache."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    return {**kwargs, "use_cache": False} if "use_cache" in kwargs else dict(kwargs)


def is_kv_cache(value: Any) -> bool:
    """A Hugging Face KV cache (transformers.cache_utils.Cache: DynamicCache, StaticCache, ...). A model that returned
    one imported transformers' cache module: nothing is imported here."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


@contextlib.contextmanager
def outputs_without_caches(model: nn.Module) -> Iterator[None]:
    """Within: `model`'s output has None in place of every KV cache in it (is_kv_cache), an object torch.export
    cannot flatten ("Found <class 'transformers.cache_utils.DynamicCache'> in output") and training never reads,
    whatever made the model return one (use_cache=True inside its forward, a cache class a config asks for). The
    tensors around it (in tuples, lists, dicts, Hugging Face ModelOutputs) stay where they are: the loss reads those.
    What planning exports (capture) and what the pipeline's stages are cut from (runtime/split.py) run so."""
    def drop_caches(module: nn.Module, args: Any, output: Any) -> Any:
        return pytree.tree_map(lambda leaf: None if is_kv_cache(leaf) else leaf, output, is_leaf=is_kv_cache)

    handle = model.register_forward_hook(drop_caches)
    try:
        yield
    finally:
        handle.remove()


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
