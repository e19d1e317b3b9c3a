"""Measured op times on disk, so that profiling the same model on the same machine again is fast.

One JSON file per (model, input shapes, device): $AUTOPLAN_CACHE, else ~/.cache/autoplan, then
timings/<key>.json. The key hashes the model spec and its file's contents, the batch's shapes and dtypes,
the device (CPU model or GPU name, threads) and the torch version. Inside, each op signature maps to its
[forward_s, backward_s], or to the reason it could not be timed. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.contract import split_spec

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Bumped when the file layout or the way ops are timed changes; older files are ignored."""


def cache_root() -> Path:
    """$AUTOPLAN_CACHE, else ~/.cache/autoplan."""
    configured = os.environ.get("AUTOPLAN_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "autoplan"


def _file_digest(model: str) -> str:
    """sha256 of the model file named by a spec "path.py[:factory]" ("" when it is not a file)."""
    try:
        return hashlib.sha256(split_spec(model)[0].read_bytes()).hexdigest()
    except OSError:
        return ""


def cache_key(model: str, inputs: list[tuple[str, tuple[int, ...], str]], device: str) -> dict:
    """What a cached file must match: the model (spec and file contents), the batch, the device."""
    return {"schema": SCHEMA_VERSION, "model": model, "model_sha256": _file_digest(model),
            "inputs": [list(map(str, (name, list(shape), dtype))) for name, shape, dtype in inputs],
            "device": device}


@dataclass
class TimingCache:
    """Op signature -> (forward_s, backward_s) or an error string, backed by one JSON file."""

    path: Path | None
    """The file (None: memory only)."""
    key: dict = field(default_factory=dict)
    """cache_key() of the profiled model; a file with another key is not reused."""
    entries: dict[str, list[float] | str] = field(default_factory=dict)
    dirty: bool = False
    """True when entries changed since loading."""

    @staticmethod
    def open(key: dict) -> "TimingCache":
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        path = cache_root() / "timings" / f"{digest}.json"
        cache = TimingCache(path, key)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return cache
        if isinstance(raw, dict) and raw.get("key") == key and isinstance(raw.get("timings"), dict):
            cache.entries = raw["timings"]
        return cache

    def get(self, signature: str) -> list[float] | str | None:
        return self.entries.get(signature)

    def put(self, signature: str, value: list[float] | str) -> None:
        self.entries[signature] = value
        self.dirty = True

    def save(self) -> None:
        """Write atomically (a temporary file renamed into place); an unwritable cache only warns."""
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as f:
                json.dump({"key": self.key, "timings": self.entries}, f, indent=0, sort_keys=True)
            os.replace(temporary, self.path)
            self.dirty = False
        except OSError as e:
            log.warning("cannot write the timing cache %s: %s", self.path, e)
