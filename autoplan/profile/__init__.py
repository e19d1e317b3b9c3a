"""Profile a captured model: per-op FLOPs, bytes, saved activations and time.

This package is also the public function autoplan.profile(model, gpu="cpu", **options): `import autoplan` imports
it and makes it callable (autoplan/__init__.py), so both spellings name one object. `from autoplan.profile import
profile_model` works, but importing this package does not import torch (`import autoplan` stays light), so the
entry points load lazily. The profile as plain data, torch-free,
is autoplan.profile_data.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"profile_model": "autoplan.profile.model_profile", "profile_graph": "autoplan.profile.model_profile"}

__all__ = ["profile_model", "profile_graph"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autoplan.profile' has no attribute {name!r}")
