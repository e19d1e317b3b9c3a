"""--pin: the parts of a layout the user fixes ("tp=8,pp=4,dp=2,zero=3,schedule=1f1b,microbatch=1")."""

from __future__ import annotations

from dataclasses import dataclass, fields

from autoplan.errors import UserError
from autoplan.layout import Layout, Scope, problems


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
    """Shorthand for dp_shard and reshard: 0 = DDP; 1, 2 = FSDP2 keeping parameters gathered; 3 = FSDP2
    resharding after forward (layout.VOCABULARY)."""
    schedule: str | None = None
    """Pipeline schedule: "gpipe", "1f1b" or "interleaved"."""
    microbatch: int | None = None
    """Samples per micro-batch."""
    recompute: str | None = None
    """Activation recomputation: "none", "selective" or "full"."""

    def as_text(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)

    def layout(self) -> Layout:
        """The pinned part of a layout (the pin keys are layout.py's short names)."""
        return Layout(**{f.name: getattr(self, f.name) for f in fields(self)})


_WORDS = ("schedule", "recompute")
"""Pin keys whose values are words; the others are integers."""


def parse_pins(text: str) -> Pins:
    """Parse "key=value,..."; every problem found (layout.problems() checks the values) is listed in one
    UserError."""
    values: dict[str, object] = {}
    found: list[str] = []
    known = [f.name for f in fields(Pins)]
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = (s.strip() for s in item.partition("="))
        key = key.lower()
        if not sep or not raw:
            found.append(f"'{item}' is not key=value")
        elif key not in known:
            found.append(f"unknown key '{key}' (known: {', '.join(known)})")
        elif key in values:
            found.append(f"'{key}' is given twice")
        elif key in _WORDS:
            values[key] = raw.lower()
        elif raw.lstrip("-").isdigit():
            values[key] = int(raw)
        else:
            found.append(f"{key}={raw} is not an integer")
    found += problems(Layout(**values), Scope())
    if found:
        raise UserError(f"invalid --pin '{text}': " + "; ".join(found))
    return Pins(**values)
