"""Helpers the generated train.py imports (its versioned interface: RUNTIME_API, which a train.py checks first,
check_runtime_api), in three subpackages by who needs them:
  distributed/  applying a plan to a model (torchtitan's distributed/): the mesh, the layout and module lists
                (ParallelConfig: one autoplan.layout.Parallelism, re-exported here as runtime.Parallelism), the
                pipeline split and steps, data/tensor/context/expert parallelism, FSDP2, recompute, compile, the
                initial weights, gradient clipping across the layout;
  components/   the training loop's parts (torchtitan's components/): data, optimizer, checkpoints, metrics, peak
                memory, profiling, preemption, TensorBoard;
  harness/      autoplan verify's harness: train.py's one hook (hooks.py) and the single-device reference run
                (reference.py).
Here: apply_plan.py (parallelize: a plan applied to a model, tying the first two together), startup.py (train.py's
start-up checks) and interface.py (RUNTIME_API).

Kept out of train.py so the program reads top to bottom like a plain training script. Everything
here is PyTorch's own parallelism (DDP, FSDP2, DTensor tensor parallel, torch.distributed.pipelining,
torch.utils.checkpoint, torch.distributed.checkpoint) wired up for a plan.
"""

from autoplan.contract import call_model, compute_loss, default_loss, load_source, model_args
from autoplan.errors import UserError
from autoplan.layout import Parallelism
from autoplan.procs import exit_skipping_teardown
from autoplan.runtime.apply_plan import Parallelized, init_plan_mesh, parallelize
from autoplan.runtime.components.checkpoint import DEFAULT_KEEP as DEFAULT_KEEP_CHECKPOINTS
from autoplan.runtime.components.checkpoint import Checkpointer
from autoplan.runtime.components.data import TrainingData, step_batch
from autoplan.runtime.components.memory import PeakLiveMemory
from autoplan.runtime.components.metrics import AppendedJson, StepMetrics, gather_rank_metrics, write_json
from autoplan.runtime.components.optimizer import adamw
from autoplan.runtime.components.preemption import SaveAndStop, stopped_line
from autoplan.runtime.components.profiling import StepProfiler
from autoplan.runtime.components.tensorboard import TensorBoardLog, default_log_dir
from autoplan.runtime.distributed.batches import microbatches, shard, to_device
from autoplan.runtime.distributed.compile import compile_modules
from autoplan.runtime.distributed.config import ParallelConfig
from autoplan.runtime.distributed.gradients import clip_grad_norm_, full_gradients
from autoplan.runtime.distributed.materialize import (ModelPart, TensorEntry, build_on_meta, build_seeded, catalog,
                                                      materialize, materialize_from, named_tensors)
from autoplan.runtime.distributed.mesh import RankLayout, RankSetup, device_mesh, global_mean_loss, rank_layout
from autoplan.runtime.distributed.parallel import (TiedGradients, compute_dtype, peak_memory_bytes,
                                                   replicate_data_parallel, shard_data_parallel)
from autoplan.runtime.distributed.recompute import checkpoint_modules
from autoplan.runtime.distributed.split import PipelineSplit, TiedParameter, split_model
from autoplan.runtime.distributed.steps import AccumulationStep, PipelineStep
from autoplan.runtime.distributed.tensor_parallel import restore_linears, tensor_parallel, tensor_parallel_context
from autoplan.runtime.harness.hooks import VerifyHook, verify_hook
from autoplan.runtime.interface import MISMATCH_EXIT_CODE, RUNTIME_API, check_runtime_api, runtime_api_mismatch
from autoplan.runtime.startup import ArgumentParser, check_start

__all__ = [
    "AccumulationStep", "ArgumentParser", "AppendedJson", "Checkpointer", "DEFAULT_KEEP_CHECKPOINTS", "MISMATCH_EXIT_CODE",
    "ModelPart", "ParallelConfig", "Parallelism", "Parallelized", "PeakLiveMemory", "PipelineSplit", "PipelineStep",
    "RUNTIME_API", "RankLayout", "RankSetup", "SaveAndStop", "StepMetrics", "StepProfiler", "UserError",
    "TensorBoardLog", "TensorEntry", "TiedGradients", "TiedParameter", "TrainingData", "VerifyHook", "adamw", "build_on_meta",
    "build_seeded", "call_model", "catalog", "check_runtime_api", "check_start", "checkpoint_modules", "clip_grad_norm_",
    "compile_modules",
    "compute_dtype", "compute_loss", "default_log_dir", "default_loss", "device_mesh", "exit_skipping_teardown",
    "full_gradients",
    "gather_rank_metrics", "global_mean_loss", "init_plan_mesh", "load_source", "materialize",
    "materialize_from",
    "microbatches", "model_args", "named_tensors", "parallelize", "peak_memory_bytes", "rank_layout",
    "replicate_data_parallel", "restore_linears", "runtime_api_mismatch", "shard", "shard_data_parallel", "split_model", "step_batch", "stopped_line", "tensor_parallel",
    "tensor_parallel_context", "to_device", "verify_hook", "write_json",
]
