"""Parameter and buffer names as the model gives them, without the parts wrappers add (below the modules that
apply a plan, which all compare names: parallel.py, batchnorm.py, gradients.py)."""

from __future__ import annotations

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
"""Path parts that wrappers (checkpointing, FSDP1, torch.compile) add to parameter names."""


def canonical_name(name: str) -> str:
    """A parameter or buffer name without the parts wrappers add (DDP's leading "module." is
    stripped by named_state)."""
    for part in WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name
