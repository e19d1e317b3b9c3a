"""--pin: the parts of a layout the user fixes ("tp=8,pp=4,dp=2,zero=3,schedule=1f1b,microbatch=1"), as a
partial layout.Layout (None: the search chooses)."""

from __future__ import annotations

from dataclasses import fields

from autoplan.errors import UserError
from autoplan.layout import VOCABULARY, Layout, Scope, problems


PIN_KEYS = tuple(term.short for term in VOCABULARY if term.pin)
"""What --pin may fix: the short names of a Layout that VOCABULARY marks as pins; the rest is left to the search."""


_WORDS = tuple(f.name for f in fields(Layout) if f.name in PIN_KEYS and f.type.startswith("str"))
"""Pin keys whose values are words (Layout's str fields); the others are integers."""


def parse_pins(text: str) -> Layout:
    """Parse "key=value,..."; every problem found (layout.problems() checks the values) is listed in one
    UserError."""
    values: dict[str, object] = {}
    found: list[str] = []
    known = PIN_KEYS
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
    return Layout(**values)
