"""Helpers the generated train.py imports: parallelize (a plan applied to a model: mesh, pipeline
split, parallel wrappers, steps, initial weights), data, checkpoints, metrics and TensorBoard logging
(--tensorboard), autoplan verify's hook (verify_hook: nothing unless verify launched the run); RUNTIME_API, the version of that interface, which a train.py checks first
(check_runtime_api).

Kept out of train.py so the program reads top to bottom like a plain training script. Everything
here is PyTorch's own parallelism (DDP, FSDP2, DTensor tensor parallel, torch.distributed.pipelining,
torch.utils.checkpoint, torch.distributed.checkpoint) wired up for a plan.
"""

from autoplan.contract import call_model, compute_loss, default_loss, load_source, model_args
from autoplan.procs import exit_skipping_teardown
from autoplan.public import callable_module
from autoplan.runtime.apply_plan import Parallelized, init_plan_mesh, parallelize
from autoplan.runtime.checkpoint import DEFAULT_KEEP as DEFAULT_KEEP_CHECKPOINTS
from autoplan.runtime.checkpoint import Checkpointer
from autoplan.runtime.compile import compile_modules
from autoplan.runtime.config import ParallelConfig
from autoplan.runtime.data import TrainingData, microbatches, shard, step_batch, to_device
from autoplan.errors import UserError
from autoplan.runtime.gradients import clip_grad_norm_, full_gradients
from autoplan.runtime.hooks import VerifyHook, verify_hook
from autoplan.runtime.interface import MISMATCH_EXIT_CODE, RUNTIME_API, check_runtime_api, runtime_api_mismatch
from autoplan.runtime.materialize import (ModelPart, TensorEntry, build_on_meta, build_seeded, catalog, materialize_from,
                                          named_tensors)
from autoplan.runtime.mesh import RankLayout, device_mesh, global_mean_loss, local_stages, rank_layout
from autoplan.runtime.memory import PeakLiveMemory
from autoplan.runtime.metrics import AppendedJson, StepMetrics, gather_rank_metrics, write_json
from autoplan.runtime.optimizer import adamw
from autoplan.runtime.profiling import StepProfiler
from autoplan.runtime.preemption import SaveAndStop, stopped_line
from autoplan.runtime.parallel import (TiedGradients, compute_dtype, peak_memory_bytes, replicate_data_parallel,
                                       shard_data_parallel)
from autoplan.runtime.recompute import checkpoint_modules
from autoplan.runtime.split import PipelineSplit, TiedParameter, split_model
from autoplan.runtime.startup import ArgumentParser, check_start
from autoplan.runtime.steps import AccumulationStep, PipelineStep
from autoplan.runtime.tensorboard import TensorBoardLog, default_log_dir
from autoplan.runtime.tensor_parallel import restore_linears, tensor_parallel_context
from autoplan.runtime import materialize, tensor_parallel  # the modules, callable as their functions below

callable_module(materialize, materialize.materialize)
callable_module(tensor_parallel, tensor_parallel.tensor_parallel)

__all__ = [
    "AccumulationStep", "ArgumentParser", "AppendedJson", "Checkpointer", "DEFAULT_KEEP_CHECKPOINTS", "MISMATCH_EXIT_CODE",
    "ModelPart", "ParallelConfig", "Parallelized", "PeakLiveMemory", "PipelineSplit", "PipelineStep",
    "RUNTIME_API", "RankLayout", "SaveAndStop", "StepMetrics", "StepProfiler", "UserError",
    "TensorBoardLog", "TensorEntry", "TiedGradients", "TiedParameter", "TrainingData", "VerifyHook", "adamw", "build_on_meta",
    "build_seeded", "call_model", "catalog", "check_runtime_api", "check_start", "checkpoint_modules", "clip_grad_norm_",
    "compile_modules",
    "compute_dtype", "compute_loss", "default_log_dir", "default_loss", "device_mesh", "exit_skipping_teardown",
    "full_gradients",
    "gather_rank_metrics", "global_mean_loss", "init_plan_mesh", "load_source", "local_stages", "materialize",
    "materialize_from",
    "microbatches", "model_args", "named_tensors", "parallelize", "peak_memory_bytes", "rank_layout",
    "replicate_data_parallel", "restore_linears", "runtime_api_mismatch", "shard", "shard_data_parallel", "split_model", "step_batch", "stopped_line", "tensor_parallel",
    "tensor_parallel_context", "to_device", "verify_hook", "write_json",
]
