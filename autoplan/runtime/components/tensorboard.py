"""TensorBoard logging for the generated train.py (`--tensorboard DIR`): every step's measured numbers beside
the plan's predictions, written by rank 0 with torch.utils.tensorboard.SummaryWriter.

Scalar tags, per optimizer step (the step number as train.py prints it, from 0):

    loss                                      the global-batch mean loss (what --losses-out writes)
    step_time_s/measured, /predicted          seconds per optimizer step
    samples_per_s/measured, /predicted
    tokens_per_s/measured, /predicted         when the inputs are tokens
    mfu/measured, /predicted                  when the planned GPU's peak FLOP/s is known
    peak_memory_gib/measured, /predicted      the largest rank's peak (on a CPU: its resident set, libraries
                                              included, against the plan's tensor memory)

Each measured/predicted pair is also one chart of TensorBoard's "Custom Scalars" tab (the two lines on one
plot). The names are plan.json's `predicted` keys (peak memory in GiB, as candidates.csv shows it).
The `tensorboard` package is optional (pip install 'torch-autoplan[tensorboard]'): asking for TensorBoard
without it stops the program at once with one line, before any process group or model is built.
"""

from __future__ import annotations

import importlib
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch.distributed as dist

MISSING_EXIT_CODE = 2
"""What train.py exits with when --tensorboard is given and the package is absent (a user error, as autoplan's)."""
FLUSH_SECS = 5
"""Seconds between SummaryWriter's flushes to disk, so a running job shows in TensorBoard within them
(torch's default is 120)."""
GIB = 2**30

PAIRS = (
    ("step_time_s", "step time (s)", "seconds", 1.0),
    ("samples_per_s", "samples per second", "samples_per_s", 1.0),
    ("tokens_per_s", "tokens per second", "tokens_per_s", 1.0),
    ("mfu", "MFU", "mfu", 1.0),
    ("peak_memory_gib", "peak memory (GiB)", "peak_memory_bytes", 1 / GIB),
)
"""(tag, chart title, key of the step's StepMetrics record, factor to the tag's unit) of each measured value
written beside its prediction. The prediction of tag T is plan.json's predicted[T], peak_memory_gib from
predicted["peak_memory_bytes"]."""


def default_log_dir(program: str | Path, now: datetime | None = None) -> Path:
    """Where `--tensorboard` without a folder writes: tensorboard/<UTC date-time>/ beside train.py, one folder
    per run, so `tensorboard --logdir tensorboard` shows every run of the plan side by side."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return Path(program).resolve().parent / "tensorboard" / stamp


def missing_tensorboard() -> str | None:
    """None when torch.utils.tensorboard imports, else the one-line reason it does not."""
    try:
        importlib.import_module("torch.utils.tensorboard")  # raises ImportError without the tensorboard package
    except ImportError as e:
        return (f"--tensorboard needs the tensorboard package ({e}): pip install tensorboard, or install "
                f"autoplan with it: pip install 'torch-autoplan[tensorboard]'")
    return None


def predicted_scalars(predicted: dict[str, Any]) -> dict[str, float]:
    """The predicted value of each tag of PAIRS that the plan has (plan.json predicted names)."""
    values = {tag: predicted.get(tag) for tag, _, _, _ in PAIRS}
    if predicted.get("peak_memory_bytes") is not None:
        values["peak_memory_gib"] = predicted["peak_memory_bytes"] / GIB
    return {tag: float(v) for tag, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardLog:
    """train.py's --tensorboard: a SummaryWriter on rank 0 (opened at the first step), nothing elsewhere and
    nothing at all when `log_dir` is None. Constructing it checks that the package imports: without it the
    program prints one line and exits MISSING_EXIT_CODE."""

    def __init__(self, log_dir: str | Path | None, predicted: dict[str, Any]) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        """Folder of the event files; None: TensorBoard is off."""
        self.predicted = predicted_scalars(predicted)
        """tag -> the plan's predicted value (PAIRS), written at every step beside the measured one."""
        self._writer = None
        if self.log_dir is None:
            return
        problem = missing_tensorboard()
        if problem:
            print(f"{Path(sys.argv[0]).name or 'train.py'}: error: {problem}", file=sys.stderr)
            raise SystemExit(MISSING_EXIT_CODE)

    def add_step(self, entry: dict[str, Any]) -> None:
        """Write one step's StepMetrics record (runtime.metrics) and the predictions beside it, on rank 0."""
        if self.log_dir is None or (dist.is_initialized() and dist.get_rank() != 0):
            return
        writer = self._open()
        step = int(entry["step"])
        writer.add_scalar("loss", float(entry["loss"]), step)
        for tag, _, key, factor in PAIRS:
            if entry.get(key) is not None:
                writer.add_scalar(f"{tag}/measured", float(entry[key]) * factor, step)
            if tag in self.predicted:
                writer.add_scalar(f"{tag}/predicted", self.predicted[tag], step)

    def close(self) -> None:
        """Flush and close the event file (a no-op where nothing was written)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=FLUSH_SECS)
            self._writer.add_custom_scalars({"autoplan: measured vs predicted": {
                title: ["Multiline", [f"{tag}/measured", f"{tag}/predicted"]] for tag, title, _, _ in PAIRS}})
            print(f"TensorBoard: writing to {self.log_dir} (watch it: tensorboard --logdir {self.log_dir})", flush=True)
        return self._writer
