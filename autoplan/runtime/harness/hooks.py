"""The one point where `autoplan verify` reaches into train.py's loop: runtime.verify_hook().

train.py asks for the hook once and, in every training step, enters `hook.step()` around the step and calls
`hook.gradients_clipped(parallel)` once the gradients are final (after backward and clipping, before the update).
As a user runs train.py (VERIFY_ENV unset) the hook is VerifyHook, which does nothing.

`autoplan verify` launches the same train.py under torchrun with VERIFY_ENV set (verify_environment), and the hook
is VerifyChecks:
  dropout off    every step runs inside runtime/distributed/dropout.py's NoDropout: the ranks draw other random numbers than
                 the single-device reference, so with dropout their losses would differ by far more than rounding;
  gradients      with "gradients_out": DIR, the first step's gradients (after clipping) are written as full tensors
                 by the model's names to DIR/rank<R>.pt (runtime/distributed/gradients.py), for verify's gradient check.
The single-device reference verify compares with is runtime/harness/reference.py's, not train.py's.
"""

from __future__ import annotations

import json
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.runtime.distributed.dropout import NoDropout
from autoplan.runtime.distributed.gradients import save_gradients

VERIFY_ENV = "AUTOPLAN_VERIFY"
"""The environment variable autoplan verify sets for the processes of the run it checks: a JSON object
{"gradients_out": DIR or null}. Read in one place, verify_hook."""
_SETTINGS = ("gradients_out",)


class VerifyHook:
    """What train.py runs at the hook's points when autoplan verify did not launch it: nothing."""

    def step(self) -> AbstractContextManager:
        """A context entered around one training step (forward, backward, clipping, update)."""
        return nullcontext()

    def gradients_clipped(self, parallel: Any) -> None:
        """Called in each step after clipping, before the update, with train.py's autoplan.Parallelized."""


class VerifyChecks(VerifyHook):
    """autoplan verify's hook: every step without dropout; the first step's gradients written to `gradients_out`."""

    def __init__(self, gradients_out: Path | None) -> None:
        self.gradients_out = gradients_out
        self.dropout = NoDropout()
        self._written = False

    def step(self) -> AbstractContextManager:
        return self.dropout

    def gradients_clipped(self, parallel: Any) -> None:
        if self.gradients_out is not None and not self._written:  # full tensors by the model's names (a collective)
            save_gradients(self.gradients_out, parallel)
            self._written = True


def verify_environment(gradients_out: Path | None) -> dict[str, str]:
    """The environment autoplan verify adds to a run it checks (VERIFY_ENV): dropout off, and with `gradients_out`
    the first step's gradients written there."""
    return {VERIFY_ENV: json.dumps({"gradients_out": None if gradients_out is None else str(gradients_out)})}


def verify_hook(env: Mapping[str, str] = os.environ) -> VerifyHook:
    """train.py's hook: VerifyChecks as VERIFY_ENV in `env` asks, VerifyHook (nothing) without it."""
    value = env.get(VERIFY_ENV)
    if not value:
        return VerifyHook()
    try:
        settings = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(f"{VERIFY_ENV}={value!r} is not JSON ({e.msg}): unset it to train as written") from None
    if not isinstance(settings, dict) or set(settings) - set(_SETTINGS):
        raise UserError(f"{VERIFY_ENV}={value!r} must be a JSON object with the keys {', '.join(_SETTINGS)} "
                        f"(autoplan verify sets it): unset it to train as written")
    gradients_out = settings.get("gradients_out")
    return VerifyChecks(Path(gradients_out) if gradients_out else None)
