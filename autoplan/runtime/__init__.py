"""Helpers the generated train.py imports: data, loss, pipeline split, parallel wrappers, steps.

Kept out of train.py so the program reads top to bottom like a plain training script.
"""

from autoplan.runtime.data import call_model, microbatches, model_args, shard, step_batch, to_device
from autoplan.runtime.loss import compute_loss, default_loss
from autoplan.runtime.parallel import (
    RankLayout,
    TiedGradients,
    checkpoint_units,
    data_parallel,
    global_mean_loss,
    init_mesh,
    peak_memory_bytes,
)
from autoplan.runtime.split import PipelineSplit, TiedParameter, split_model
from autoplan.runtime.steps import AccumulationStep, PipelineStep

__all__ = [
    "AccumulationStep", "PipelineSplit", "PipelineStep", "RankLayout", "TiedGradients", "TiedParameter",
    "call_model", "checkpoint_units", "compute_loss", "data_parallel", "default_loss", "global_mean_loss",
    "init_mesh", "microbatches", "model_args", "peak_memory_bytes", "shard", "split_model", "step_batch",
    "to_device",
]
