"""--pin: the parts of a layout the user fixes ("tp=8,pp=4,dp=2,zero=3,schedule=1f1b,microbatch=1")."""

from __future__ import annotations

from dataclasses import dataclass, fields

from autoplan.errors import UserError
from autoplan.plan import RECOMPUTE, SCHEDULES


@dataclass(frozen=True)
class Pins:
    """Fixed choices; None leaves the choice to the search."""

    dp: int | None = None
    """Total data-parallel degree (sharded when zero = 3)."""
    tp: int | None = None
    """Tensor-parallel degree."""
    pp: int | None = None
    """Pipeline stages."""
    zero: int | None = None
    """ZeRO stage 0-3 (3 = FSDP)."""
    schedule: str | None = None
    """Pipeline schedule: "gpipe", "1f1b" or "interleaved"."""
    microbatch: int | None = None
    """Samples per micro-batch."""
    recompute: str | None = None
    """Activation recomputation: "none", "selective" or "full"."""

    def as_text(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)


_POSITIVE_INTS = ("dp", "tp", "pp", "microbatch")
_CHOICES = {"schedule": SCHEDULES, "recompute": RECOMPUTE}
_ZERO_STAGES = (0, 1, 2, 3)


def parse_pins(text: str) -> Pins:
    """Parse "key=value,..."; every problem found is listed in one UserError."""
    values: dict[str, object] = {}
    problems: list[str] = []
    known = [f.name for f in fields(Pins)]
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = (s.strip() for s in item.partition("="))
        key = key.lower()
        if not sep or not raw:
            problems.append(f"'{item}' is not key=value")
        elif key not in known:
            problems.append(f"unknown key '{key}' (known: {', '.join(known)})")
        elif key in values:
            problems.append(f"'{key}' is given twice")
        else:
            value, problem = _parse_value(key, raw)
            if problem:
                problems.append(problem)
            else:
                values[key] = value
    if problems:
        raise UserError(f"invalid --pin '{text}': " + "; ".join(problems))
    return Pins(**values)


def _parse_value(key: str, raw: str) -> tuple[object, str]:
    if key in _CHOICES:
        choice = raw.lower()
        if choice not in _CHOICES[key]:
            return None, f"{key}={raw} is not one of {', '.join(_CHOICES[key])}"
        return choice, ""
    try:
        number = int(raw)
    except ValueError:
        return None, f"{key}={raw} is not an integer"
    if key == "zero" and number not in _ZERO_STAGES:
        return None, f"zero={number} is not a ZeRO stage (0, 1, 2 or 3)"
    if key in _POSITIVE_INTS and number < 1:
        return None, f"{key}={number} must be at least 1"
    return number, ""
