"""Modules that hold cross-sample state (torch-free): BatchNorm in training mode normalizes each channel
with the mean and variance over the batch it sees and folds them into its running statistics. Such a
model trains like the single-device model only if every call sees the whole global batch's statistics:
synchronized over the data-parallel ranks (SyncBatchNorm), never split into micro-batches.

Found by op name in the captured graph (the model is captured in training mode): the ATen ops
BatchNorm's training forward dispatches to. The eval-mode op (_native_batch_norm_legit_no_training)
reads the running statistics only, so it is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.chain.ops import packet
from autoplan.profile_data import ModelProfile, OpProfile

BATCH_STATISTICS_OPS = frozenset({
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_impl_index",
    "cudnn_batch_norm", "miopen_batch_norm",
})
"""Op packets that compute statistics over the batch dimension in training mode."""


@dataclass(frozen=True)
class BatchStatistics:
    """One call of a module that normalizes over the batch."""

    module: str
    """FQN of the module (e.g. "blocks.0.bn1")."""
    channels: int
    """Channels it keeps a mean and a variance of (the input's dimension 1)."""


def batch_statistics(profile: ModelProfile) -> tuple[BatchStatistics, ...]:
    """Every call of a batch-statistics op in the graph, in graph order (a module called twice is listed
    twice: each call synchronizes its own statistics)."""
    return tuple(BatchStatistics(op.module, _channels(op)) for op in profile.ops
                 if packet(op) in BATCH_STATISTICS_OPS)


def batch_statistics_modules(calls: tuple[BatchStatistics, ...]) -> tuple[str, ...]:
    """The modules of `calls`, each once, in the order they first run."""
    return tuple(dict.fromkeys(call.module for call in calls))


def _channels(op: OpProfile) -> int:
    """Dimension 1 of the op's input (N, C, ...); 1 for an input of fewer dimensions."""
    shape = op.input_shapes[0] if op.input_shapes else ()
    return shape[1] if len(shape) > 1 else 1
