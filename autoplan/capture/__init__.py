"""Capture a model's forward as an OpGraph of ATen ops on fake tensors (nothing is allocated).

torch.export (non-strict) first; if it fails, a dispatch-mode recording of a fake forward, with the
reason export failed kept in OpGraph.failures.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from autoplan.capture.dispatch import capture_dispatch
from autoplan.capture.export import capture_export
from autoplan.capture.fake_model import FakeModel, build_fake_model
from autoplan.capture.graph import GraphInput, OpGraph, OpNode, TensorMeta, ValueRef
from autoplan.errors import UserError
from autoplan.source import ModelSource

METHODS = ("auto", "export", "dispatch")
"""capture_model's `method` choices: auto tries export, then dispatch."""

log = logging.getLogger(__name__)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback at ERROR for every failing shape check; the user gets the
    one-line UserError instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def capture_model(source: ModelSource, batch_size: int, method: str = "auto") -> OpGraph:
    """The forward graph of `source`'s model on example_batch(batch_size)."""
    if method not in METHODS:
        raise UserError(f"unknown capture method {method!r}: choose one of {', '.join(METHODS)}")
    with _quiet_fake_tensor_log():
        fake = build_fake_model(source, batch_size)
        failures: list[str] = []
        if method in ("auto", "export"):
            try:
                return capture_export(fake)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - export fails in many ways; each means "try the fallback"
                if method == "export":
                    raise UserError(f"torch.export of {source.path.name} failed: {_one_line(e)}") from None
                failures.append(f"export: {_one_line(e)}")
        graph = capture_dispatch(fake, source, tuple(failures))
    if failures:
        log.warning("torch.export failed (%s); captured by recording dispatched ops instead", failures[0])
    return graph


__all__ = ["capture_model", "build_fake_model", "FakeModel", "OpGraph", "OpNode", "GraphInput", "TensorMeta",
           "ValueRef", "METHODS"]
