"""Capture a model's forward as an OpGraph of ATen ops on fake tensors (nothing is allocated).

A chain of methods, each tried when the one before fails, so that a model that runs eagerly can always
be profiled; why each earlier method failed is kept in OpGraph.failures:

1. "export": torch.export (non-strict), the cleanest graph; a KV cache in the output is dropped from it, as the
   pipeline's stages drop it (contract.outputs_without_caches).
2. "symbolic_trace": make_fx tracing of the forward flattened to tensors (custom output objects).
3. "dispatch": record the ops a dispatch mode sees while the forward runs on fake tensors.
4. "dispatch" on real tensors, for a model of at most REAL_RUN_MAX_STATE_BYTES whose forward needs
   tensor values (data-dependent control flow, an op without a fake kernel).

Runs of identical blocks (the layers of a transformer) are traced three deep and replicated
(capture/repeats.py), so an 80-layer model costs about as much to capture as a 3-layer one.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Callable, Iterator

from torch import nn

from autoplan.capture.dispatch import DataDependentError, capture_dispatch
from autoplan.capture.export import capture_export
from autoplan.capture.fake_model import FakeModel, build_fake_model, build_real_model
from autoplan.capture.graph import GraphInput, OpGraph, OpNode, TensorMeta, ValueRef
from autoplan.capture.masks import positions_in, recording_mask_skips
from autoplan.capture.repeats import Run, expand, find_runs, truncated
from autoplan.capture.trace import capture_trace
from autoplan.errors import UserError
from autoplan.contract import ModelSource

METHODS = ("auto", "export", "symbolic_trace", "dispatch")
"""capture_model's `method` choices: auto tries each of the others in turn."""

REAL_RUN_MAX_STATE_BYTES = 1 << 30
"""Largest model (parameters + buffers, bytes) that is built for real to record a forward that fake
tensors cannot run: 1 GiB, a small fraction of a laptop's memory."""

log = logging.getLogger(__name__)


def _one_line(error: BaseException, model: nn.Module | None = None) -> str:
    """"Type: first line of the message", and with the `model` traced, where in it the error arose."""
    text = str(error).strip().splitlines()
    where = _where_in_model(error, model) if model is not None else None
    return f"{type(error).__name__}: {text[0] if text else ''}" + (f" ({where})" if where else "")


def _where_in_model(error: BaseException, model: nn.Module) -> str | None:
    """"in module NAME (Type), at FILE:LINE in FUNC": the innermost frame of `error`'s traceback that runs a
    method of one of `model`'s modules (the model's own code, wherever its file lies: a transformers
    model's is under site-packages). None when no frame does."""
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    found = None
    traceback = error.__traceback__
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if id(owner) in names and isinstance(owner, nn.Module):
            found = (names[id(owner)], type(owner).__name__, traceback.tb_frame.f_code, traceback.tb_lineno)
        traceback = traceback.tb_next
    if found is None:
        return None
    name, kind, code, line = found
    module = f"{name} ({kind})" if name else f"the model's root ({kind})"
    return f"in module {module}, at {Path(code.co_filename).name}:{line} in {code.co_name}"


_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export", "torch._export",
                  "torch.fx.experimental.symbolic_shapes")
"""Loggers that print tracebacks or partial graphs for every failed tracing attempt; the user gets one
line per failed method instead (OpGraph.failures, a warning)."""


@contextlib.contextmanager
def _quiet_tracing_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _try_tracer(tracer: Callable[[FakeModel], OpGraph], fake: FakeModel) -> OpGraph:
    """Run a tracer; export prints the partial graph of a failed attempt to stderr, which is dropped."""
    with contextlib.redirect_stderr(io.StringIO()):
        return tracer(fake)


_TRACERS: dict[str, Callable[[FakeModel], OpGraph]] = {"export": capture_export, "symbolic_trace": capture_trace}


def capture_model(source: ModelSource, batch_size: int, method: str = "auto", reuse_repeats: bool = True) -> OpGraph:
    """The forward graph of `source`'s model on example_batch(batch_size).

    With `reuse_repeats`, runs of identical blocks are traced once and replicated (capture/repeats.py);
    if that does not work out the model is captured whole."""
    if method not in METHODS:
        raise UserError(f"unknown capture method {method!r}: choose one of {', '.join(METHODS)}")
    mask_skips: list[bool] = []
    with _quiet_tracing_logs():
        fake = build_fake_model(source, batch_size)
        with recording_mask_skips(mask_skips, positions_in(fake.model, fake.args, fake.kwargs)):
            runs = find_runs(fake.model) if reuse_repeats else []
            graph = _capture_repeated(fake, source, method, runs) if runs else None
            if graph is None:
                mask_skips.clear()  # the whole model's masks, not those of a cut-short capture that failed
                graph = _capture_chain(fake, source, method, allow_real=True)
    graph.mask_skips = tuple(mask_skips)
    if graph.failures:
        log.warning("captured %s by %s (%s)", source.path.name, graph.method, "; ".join(graph.failures))
    return graph


def _capture_repeated(fake: FakeModel, source: ModelSource, method: str, runs: list[Run]) -> OpGraph | None:
    """Capture with each run of identical blocks cut short, then replicate; None if that fails."""
    try:
        with truncated(fake.model, runs):
            graph = _capture_chain(fake, source, method, allow_real=False)
        for run in runs:
            graph = expand(graph, run)
    except Exception as e:  # noqa: BLE001 - the shortcut failing in any way means: capture the model whole
        log.debug("capturing %s with repeated blocks cut failed (%s); capturing it whole", source.path.name, e)
        return None
    graph.parameters = fake.trainable_parameters()
    return graph


def _capture_chain(fake: FakeModel, source: ModelSource, method: str, allow_real: bool) -> OpGraph:
    """Try the capture methods in turn (only `method` unless it is "auto")."""
    failures: list[str] = []
    for name, tracer in _TRACERS.items():
        if method not in ("auto", name):
            continue
        try:
            graph = _try_tracer(tracer, fake)
            graph.failures = tuple(failures)
            return graph
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - tracing fails in many ways; each means "try the next method"
            if method == name:
                raise UserError(f"{_DESCRIPTIONS[name]} of {source.path.name} failed: {_one_line(e)}") from None
            failures.append(f"{name}: {_one_line(e, fake.model)}")
    return _capture_by_running(fake, source, failures, allow_real)


_DESCRIPTIONS = {"export": "torch.export", "symbolic_trace": "symbolic tracing (make_fx)"}


def _capture_by_running(fake: FakeModel, source: ModelSource, failures: list[str], allow_real: bool) -> OpGraph:
    """Record the forward on fake tensors, or (if `allow_real`) on real ones when fake tensors cannot
    run it and the model is small enough to build."""
    try:
        return capture_dispatch(fake, source, tuple(failures))
    except DataDependentError as e:
        if not allow_real:
            raise
        size = fake.state_bytes()
        if size > REAL_RUN_MAX_STATE_BYTES:
            raise UserError(f"cannot capture {source.path.name} on fake tensors ({e}), and at "
                            f"{size / 2**30:.1f} GiB of parameters it is too large to run for real "
                            f"(limit {REAL_RUN_MAX_STATE_BYTES / 2**30:.0f} GiB)") from None
        failures.append(f"dispatch on fake tensors: {e}; recorded on real tensors with random weights")
    real = build_real_model(source, fake.batch_size)
    return capture_dispatch(real, source, tuple(failures))


__all__ = ["capture_model", "build_fake_model", "FakeModel", "OpGraph", "OpNode", "GraphInput", "TensorMeta",
           "ValueRef", "METHODS"]
