"""The version of the interface between a generated train.py and autoplan.runtime.

A train.py calls runtime.* by name with arguments in a given order and meaning. Each program records the
RUNTIME_API it was generated for and calls check_runtime_api first, so a program and an installed autoplan
that do not match stop at once with one line that says what to do, instead of failing later (or, worse,
training differently) on a renamed function or a changed argument.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

RUNTIME_API = 12
"""Bump it (and RUNTIME_API in codegen/templates/train.py) with any change to what a train.py calls that a
train.py generated before would call wrongly, or that one generated now would not find in an autoplan before:
a name added, removed or renamed, a signature, a meaning. A train.py reaches autoplan through autoplan.runtime
(and autoplan.parallelize, autoplan.init_mesh) only, and checks this first, at import, before any other autoplan
name (tests/test_codegen.py). 5: runtime.exit_skipping_teardown and runtime.load_source (train.py imported
autoplan.procs and autoplan.source (now autoplan.contract) directly, so on an autoplan without procs it died of an ImportError before
its check); autoplan.init_mesh(timeout_s=) for the process group's timeout; the tensor-parallel plan's
'replicate' style (a norm's weight inside a split region, a replicated DTensor whose gradient is summed).
6: the tensor-parallel plan's 'sequence_local' style (a MoE block run on each rank's sequence shard); the expert
mesh folded over dp_shard x cp x tp (a plan's expert_parallel_degree may span tensor-parallel ranks, which an
autoplan before would split over data-parallel ranks only). 7: the zero-bubble pipeline schedules (a plan's
pipeline_parallel_schedule may be zb-interleaved, zbv or dualpipev, whose V placement an autoplan before lacks).
8: the zero-bubble schedules with data or context parallelism (each stage reduces its gradients after its last
weight-gradient pass, no DDP: an autoplan before would leave the replicas' gradients unreduced). 9: checkpoints
saved whole or not at all and kept K at a time (Checkpointer(keep=), runtime.DEFAULT_KEEP_CHECKPOINTS),
Checkpointer.load(total_steps) saying what it resumed from, losses and metrics written per step
(runtime.AppendedJson, runtime.write_json). 10: runtime.check_start (the plan's fingerprint, PLAN_FINGERPRINT,
against the plan.json beside train.py or --plan, and the launch: torchrun, the world size, the device) and
runtime.ArgumentParser (an argument mistake in one line); checkpoints keyed by the model's own names whatever the
split, with each rank's generators and data position (Checkpointer(directory, parallel, optimizer, keep=, data=)
takes the Parallelized, Parallelized.model_names, TrainingData.position/restore), save and stop on SIGUSR1
(runtime.SaveAndStop, runtime.stopped_line, runtime.UserError caught by train.py's __main__); runtime.StepProfiler (train.py --profile DIR); gradient clipping
(Parallelized.clip_grad_norm_, runtime.clip_grad_norm_); runtime.adamw(weight_decay=, betas=);
StepMetrics.record(lr=, grad_norm=). 11: autoplan verify's reference run and verify-only flags out of train.py:
train.py has no --reference, --no-dropout, --dropout-out, --gradients-out nor train_reference; verify launches the
same train.py with AUTOPLAN_VERIFY set, which runtime.verify_hook() reads (runtime.VerifyHook: hook.step() around
each step, hook.gradients_clipped(parallel) after clipping; runtime.NoDropout, runtime.save_gradients and
runtime.save_reference_gradients left the interface), and trains the single-device reference in
autoplan/runtime/harness/reference.py, which imports train.py and reads its SEED, GLOBAL_BATCH, DP, OPTIMIZER_IMPLEMENTATION,
parse_args, get_lr and load_model_source(args) (new); runtime.check_start(program_file, fingerprint, config, plan,
device) lost its `reference` argument. Also in 11: runtime's modules moved into distributed/, components/ and
harness/ (the names a train.py reads through autoplan.runtime are unchanged; runtime.materialize and
runtime.tensor_parallel are the functions, no longer their modules made callable). 12: one layout type: train.py's
layout constants are autoplan.layout.Parallelism's fields upper case, in their types and order (RESHARD, SP,
LOSS_PARALLEL and OFFLOAD are True/False, no longer "always"/"never" and "on"/"off"; DP is gone: rank.dp, and
the reference run reads parallel_config().parallelism.dp), and parallel_config() builds runtime.Parallelism (new)
and runtime.ParallelConfig(parallelism, stages=, tensor_parallel_plan=, recompute_modules=, batch_norm_modules=,
compile=, dtype=), whose layout fields (dp_shard=, sequence_parallel=, microbatch_size=, num_microbatches=, reshard=
"always", ...) and arithmetic() left it (Parallelism.world_size_arithmetic()). Runtime functions take the layout
instead of loose degrees: device_mesh(device, parallelism, timeout_s), rank_layout(mesh, parallelism),
parallelize_experts(module, parallelism, device_type, dtype, tp_mesh), expert_mesh(device_type, parallelism),
shard_data_parallel(module, mesh, config, chain_modules, dtype, experts), AccumulationStep(module, parallelism,
loss_fn, dtype, context_parallel), PipelineStep(parts, split, runtime.RankSetup(...) (new), loss_fn,
context_parallel), tensor_parallel(..., sp=) (was sequence_parallel=); runtime.local_stages left
(Parallelism.rank_stages). Also in 12, one name per concept in the runtime too: RankLayout's degrees are dp, pp, tp and cp
(were dp_size, pp_size, tp_size, cp_size; train.py reads rank.dp), TrainingData(source, global_batch, seed, dp_rank,
dp) (was dp_size=); StepMetrics takes the device and verbose (StepMetrics(..., peak_flops_per_gpu, device,
verbose=)) and StepMetrics.record(step, loss, seconds, lr=, grad_norm=) no longer does."""

MISMATCH_EXIT_CODE = 2
"""What a program exits with on a mismatch: 2, the exit code of autoplan's own user errors (the user fixes
it by regenerating train.py or installing another autoplan; nothing crashed)."""


def runtime_api_mismatch(program_api: int) -> str | None:
    """None if this autoplan.runtime provides `program_api`, else the one-line message that says which
    version the program needs, which this autoplan provides and what to do."""
    if program_api == RUNTIME_API:
        return None
    return (f"this train.py was generated for autoplan runtime API {program_api}, but the installed "
            f"{_installed_autoplan()} provides runtime API {RUNTIME_API}: re-run autoplan on the model "
            f"(autoplan MODEL.py --gpus N ...) to regenerate train.py, or install the autoplan that "
            f"generated it (runtime API {program_api})")


def check_runtime_api(program_api: int) -> None:
    """Return if this autoplan.runtime provides `program_api`, else print the mismatch as one line on
    stderr and exit with MISMATCH_EXIT_CODE (SystemExit: no traceback)."""
    problem = runtime_api_mismatch(program_api)
    if problem is None:
        return
    print(f"{Path(sys.argv[0]).name or 'train.py'}: error: {problem}", file=sys.stderr)
    raise SystemExit(MISMATCH_EXIT_CODE)


def _installed_autoplan() -> str:
    """"autoplan 0.1.0" (the installed distribution torch-autoplan), else "autoplan" from a bare source tree."""
    try:
        return f"autoplan {version('torch-autoplan')}"
    except PackageNotFoundError:
        return "autoplan"
