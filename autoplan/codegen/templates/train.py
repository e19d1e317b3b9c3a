"""Template of the train.py that autoplan writes for a plan (autoplan/codegen/program.py).

render_train_py writes the plan's own docstring (layout, launch command) in place of this one and the
plan's numbers in place of the placeholder lines between the two plan config markers; every other line
is copied as it is. The placeholders keep this file a valid program: a linter checks it and a test
imports it (tests/test_codegen.py). autoplan itself never imports it: it reads it as text.
"""

import argparse
import contextlib
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autoplan
from autoplan import runtime

RUNTIME_API = 12  # the version of autoplan's interface to programs (autoplan.runtime) this one was generated for
runtime.check_runtime_api(RUNTIME_API)  # before any other autoplan name: one line and exit 2 if autoplan differs

# ----------------------------------------------------------------------------------------------
# The plan (numbers from plan.json)
# --- plan config begin ---
MODEL_SOURCE = "model.py"  # placeholders, replaced by the plan's values (program.py, _config_block)
PLAN_FINGERPRINT = ""
MODEL_FILE = Path(__file__).parent / "model_code" / "model.py"
FACTORY = "build_model"
SEED = 0
LEARNING_RATE = 1e-3
OPTIMIZER_IMPLEMENTATION = "fused"
GLOBAL_BATCH = 1
DTYPE = "fp32"
DP_REPLICATE = 1
DP_SHARD = 1
RESHARD = False
TP = 1
PP = 1
SCHEDULE = "1f1b"
MICROBATCH = 1
MICROBATCHES = 1
RECOMPUTE = "none"
VIRTUAL_STAGES = 1
SP = False
LOSS_PARALLEL = True
OFFLOAD = False
CP = 1
EP = 1
COMPILE = False
TOKENS_PER_SAMPLE = None
MODEL_FLOPS_PER_STEP = 0.0
PEAK_FLOPS_PER_GPU = None
PROCESS_GROUP_TIMEOUT_S = 1800.0
CHECKPOINT_EVERY = 0
PREDICTED = {}
TENSOR_PARALLEL_PLAN = {}
RECOMPUTE_MODULES = []
BATCH_NORM_MODULES = []
STAGES = [[]]
# --- plan config end ---
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = runtime.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="train until this many optimizer steps are done")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    # the optimizer: AdamW, the learning rate warmed up linearly then decayed on a cosine to --min-lr at --steps
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="peak learning rate (default: the plan's)")
    parser.add_argument("--min-lr", type=float, default=None, help="learning rate at the last step (default: lr / 10)")
    parser.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                        help="steps of linear warmup (default: 5%% of --decay-steps)")
    parser.add_argument("--decay-steps", type=int, default=None, metavar="N",
                        help="the step count the schedule spans: the cosine reaches --min-lr at its last step "
                             "(default: --steps; a run stopped early and resumed keeps it)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95), metavar=("BETA1", "BETA2"))
    parser.add_argument("--clip-grad-norm", type=float, default=1.0, metavar="MAX",
                        help="clip the gradients to this global norm before each update (0: no clipping)")
    parser.add_argument("--process-group-timeout", type=float, default=PROCESS_GROUP_TIMEOUT_S, metavar="SECONDS",
                        help="how long a collective waits for every rank before failing (default: sized to the "
                             "time rank 0 takes to build the model on the CPU while the others wait)")
    parser.add_argument("--model-file", choices=("copy", "planned"), default="copy",
                        help="copy: MODEL_FILE, the copy in model_code/ beside this file made at planning, with the "
                             "modules beside the model file that it imports (default); planned: the file it was "
                             "planned from, MODEL_SOURCE, as it is now, importing its neighbours there (its edits "
                             "since then train too)")
    parser.add_argument("--plan", type=Path, metavar="PLAN.json",
                        help="refuse to run unless this is the plan this file was generated from (PLAN_FINGERPRINT; "
                             "default: the plan.json beside this file, when there is one)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (torch.distributed.checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY, metavar="N",
                        help="with --checkpoint-dir, save every N steps and after the last (0: at the end only; "
                             "default: CHECKPOINT_EVERY, about 30 minutes of the plan's predicted steps)")
    parser.add_argument("--resume", action="store_true", default=None,
                        help="continue from the newest checkpoint in --checkpoint-dir (default: when torchrun "
                             "restarted the processes, TORCHELASTIC_RESTART_COUNT > 0, and --checkpoint-dir is set)")
    parser.add_argument("--keep-checkpoints", type=int, default=runtime.DEFAULT_KEEP_CHECKPOINTS, metavar="K",
                        help="keep the newest K checkpoints, older ones to fall back on should the newest not load "
                             "(0: all; default %(default)s)")
    parser.add_argument("--losses-out", type=Path, help="write the per-step losses here (JSON list, after every step)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="trace the last steps with torch.profiler into DIR (a Chrome/Perfetto trace per rank)")
    parser.add_argument("--metrics-out", type=Path,
                        help="write losses, step times and peak memory here (JSON, the steps after every step)")
    parser.add_argument("--tensorboard", type=Path, nargs="?", const=runtime.default_log_dir(__file__), metavar="DIR",
                        help="log every step's loss, step time, throughput, MFU and peak memory beside the plan's "
                             "predictions (PREDICTED) for TensorBoard, from rank 0, into DIR; without DIR into "
                             "tensorboard/<UTC date-time>/ beside this file (needs the tensorboard package)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=COMPILE,
                        help="torch.compile each of the plan's chain modules (default: the plan's compile.enable)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (the optimizer steps to train until), not {args.steps}")
    if args.process_group_timeout <= 0:
        parser.error(f"--process-group-timeout must be a positive number of seconds, not {args.process_group_timeout:g}")
    if args.resume is None:  # a restart by torchrun (--max-restarts) resumes on its own
        args.resume = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and args.checkpoint_dir is not None
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be 0 (at the end only) or a number of steps, not {args.checkpoint_every}")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.decay_steps = args.steps if args.decay_steps is None else args.decay_steps
    args.warmup_steps = args.decay_steps // 20 if args.warmup_steps is None else args.warmup_steps
    if args.warmup_steps < 0 or args.clip_grad_norm < 0:
        parser.error(f"--warmup-steps ({args.warmup_steps}) and --clip-grad-norm ({args.clip_grad_norm}) must be >= 0")
    return args


def get_lr(step: int, args) -> float:
    """The learning rate of `step` (from 0): linear warmup over args.warmup_steps, then a cosine from args.lr down
    to args.min_lr at step args.decay_steps - 1 (nanoGPT's schedule), args.min_lr after."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / (args.warmup_steps + 1)
    decay_steps = max(1, args.decay_steps - 1 - args.warmup_steps)
    ratio = min(1.0, (step - args.warmup_steps) / decay_steps)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def load_model_source(args):
    """The model file's functions (build_model, loss_fn, example_batch, make_dataloader): MODEL_FILE, the copy
    beside this file, or with --model-file planned the file it was planned from, MODEL_SOURCE."""
    return runtime.load_source(f"{MODEL_SOURCE if args.model_file == 'planned' else MODEL_FILE}:{FACTORY}")


def parallel_config(compile_modules=COMPILE) -> runtime.ParallelConfig:
    """The plan's layout (an autoplan Parallelism: each constant above is its field, upper case) and the modules it
    names, as autoplan.parallelize reads them; the chain modules compiled when `compile_modules`."""
    layout = runtime.Parallelism(
        dp_replicate=DP_REPLICATE, dp_shard=DP_SHARD, reshard=RESHARD, tp=TP, pp=PP, schedule=SCHEDULE,
        microbatch=MICROBATCH, microbatches=MICROBATCHES, recompute=RECOMPUTE, virtual_stages=VIRTUAL_STAGES, sp=SP,
        loss_parallel=LOSS_PARALLEL, offload=OFFLOAD, cp=CP, ep=EP)
    return runtime.ParallelConfig(layout, stages=STAGES, tensor_parallel_plan=TENSOR_PARALLEL_PLAN,
                                  recompute_modules=RECOMPUTE_MODULES, batch_norm_modules=BATCH_NORM_MODULES,
                                  compile=compile_modules, dtype=DTYPE)


def build_parallel_model(model_source, config, mesh, device) -> autoplan.Parallelized:
    """This rank's share of the model (autoplan.parallelize: its pipeline stages, tensor-parallel and
    data-parallel shards, recompute, compile) and its forward + backward of one step (with context
    parallelism, on its share of each sequence), with the same initial values as the single-device
    model (see runtime.materialize)."""
    model = runtime.build_on_meta(model_source)  # the structure only: no memory yet
    # with a pipeline, the stages are cut from the graph exported on one micro-batch; with context
    # parallelism, the modules that call attention are found by running it on one (fake tensors)
    example_inputs = model_source.example_batch(MICROBATCH)[0] if PP > 1 or CP > 1 else None
    return autoplan.parallelize(model, config, mesh, device=device, example_inputs=example_inputs,
                                loss_fn=model_source.loss_fn,
                                initial_values=lambda: runtime.build_seeded(model_source, SEED))  # rank 0 only


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    board = runtime.TensorBoardLog(args.tensorboard, PREDICTED)  # one line and exit 2 without the package
    # one line and exit 2 beside another plan.json, without torchrun, with another number of processes
    runtime.check_start(__file__, PLAN_FINGERPRINT, parallel_config(), args.plan, args.device)
    device = torch.device(args.device)
    model_source = load_model_source(args)
    # autoplan verify's checks (dropout off, the first step's gradients written) when it launched this run; as
    # you run it, nothing (runtime/harness/hooks.py)
    verify = runtime.verify_hook()

    # processes and the device mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    config = parallel_config(args.compile)
    mesh = autoplan.init_mesh(config, device, timeout_s=args.process_group_timeout)
    parallel = build_parallel_model(model_source, config, mesh, device)
    rank, parts = parallel.rank, parallel.parts
    optimizer = runtime.adamw(parallel.parameters(), args.lr, OPTIMIZER_IMPLEMENTATION, args.weight_decay, args.betas)

    data = runtime.TrainingData(model_source, GLOBAL_BATCH, SEED, rank.dp_rank, rank.dp)
    # keyed by the model's own names (any plan resumes any other's), with each rank's generators and data position
    checkpoints = runtime.Checkpointer(args.checkpoint_dir, parallel, optimizer, keep=args.keep_checkpoints, data=data)
    first_step = checkpoints.load(args.steps) if args.resume else 0  # says what it resumed from, or that it found none
    stop = runtime.SaveAndStop(device)  # SIGUSR1 (SLURM, before the time limit): save at the next step and stop
    metrics = runtime.StepMetrics(GLOBAL_BATCH, dist.get_world_size(), TOKENS_PER_SAMPLE, MODEL_FLOPS_PER_STEP,
                                  PEAK_FLOPS_PER_GPU, device, verbose=rank.rank == 0)
    # --metrics-out: the last step also records the peak of live tensor memory (slower: not timed)
    memory = runtime.PeakLiveMemory(device)
    losses = []
    # rank 0 extends --losses-out and --metrics-out after every step: a killed run keeps what it trained
    losses_file = runtime.AppendedJson(args.losses_out if rank.rank == 0 else None)
    steps_file = runtime.AppendedJson(args.metrics_out if rank.rank == 0 else None, {"first_step": first_step})
    profiler = runtime.StepProfiler(args.profile, args.steps - first_step, rank.rank, device)  # --profile
    for step in range(first_step, args.steps):
        tracked = args.metrics_out is not None and step == args.steps - 1
        start = time.perf_counter()
        with verify.step(), memory if tracked else contextlib.nullcontext():
            inputs, targets = runtime.to_device(data.batch(step), device)  # this data-parallel rank's share
            optimizer.zero_grad(set_to_none=True)
            local_loss = parallel.forward_backward(inputs, targets)  # and tied weights' gradients summed
            grad_norm = parallel.clip_grad_norm_(args.clip_grad_norm)  # the whole model's norm, on every layout
            verify.gradients_clipped(parallel)
            lr = get_lr(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        losses.append(runtime.global_mean_loss(local_loss, rank, device))  # mean over the global batch
        entry = metrics.record(step, losses[-1], time.perf_counter() - start, lr=lr, grad_norm=grad_norm)
        board.add_step(entry)  # --tensorboard: measured beside predicted, rank 0 only
        losses_file.append(losses[-1])
        steps_file.append(entry)
        profiler.step()
        stopping = stop.requested()  # any rank signalled (a collective: every rank stops at this step)
        saved = None
        if checkpoints.due(step + 1, args.steps, args.checkpoint_every) or (stopping and args.checkpoint_dir):
            saved = checkpoints.save(step + 1)
        if stopping:
            if rank.rank == 0:
                print(runtime.stopped_line(step + 1, saved), flush=True)
            break

    profiler.close()
    stop.close()
    board.close()
    losses_file.close()
    steps_file.close()
    if args.metrics_out:  # every rank's own step times and peak memory, written by rank 0
        ranks = runtime.gather_rank_metrics(rank, sorted(parts), metrics.history, memory)
        if rank.rank == 0:
            runtime.write_json(args.metrics_out, {"first_step": first_step, "losses": losses,
                                                  "steps": metrics.history, "ranks": ranks})
    # free the parallel wrappers now, while the interpreter is alive: their hooks hold the process groups
    # in reference cycles, and a gloo group torn down during interpreter exit can abort the process
    del parallel, checkpoints, optimizer, parts, mesh
    gc.collect()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    try:
        main()
    except runtime.UserError as error:  # e.g. no checkpoint loads: one line (rank 0) and exit 2, no traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: {error}", file=sys.stderr, flush=True)
        runtime.exit_skipping_teardown(2)
    runtime.exit_skipping_teardown(0)  # a gloo group torn down at interpreter exit can abort a finished run (SIGABRT)
