"""Write the training program for a plan: train.py, a copy of the model file, launch/.

Every value from the plan enters train.py as a Python literal made by repr() (module names, the
factory name, paths can be any string), and the docstring holds only numbers and fixed words, so
no plan or file name can change what the program does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from autoplan.codegen.launch import Launch, launch_layout, launcher_files
from autoplan.codegen.train_template import TRAIN_PY
from autoplan.errors import UserError
from autoplan.plan import RECOMPUTE, SCHEDULES, TENSOR_PARALLEL_STYLES, Plan


def write_program(plan: Plan, out_dir: Path, model_file: Path) -> None:
    """Write out_dir/train.py, out_dir/model.py (a copy of `model_file`) and out_dir/launch/."""
    check_supported(plan)
    launch = launch_layout(plan)
    model_file = Path(model_file)
    if not model_file.is_file():
        raise UserError(f"model file not found: {model_file}")
    out_dir = Path(out_dir)
    (out_dir / "launch").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, out_dir / "model.py")
    (out_dir / "train.py").write_text(render_train_py(plan, launch))
    for name, text in launcher_files(launch).items():
        (out_dir / "launch" / name).write_text(text)
    (out_dir / "launch" / "torchrun.sh").chmod(0o755)


def check_supported(plan: Plan) -> None:
    """Reject plans the generated program cannot run, with the numbers that conflict."""
    p = plan.parallelism
    problems = []
    degrees = {"data_parallel_replicate_degree": p.data_parallel_replicate_degree,
               "data_parallel_shard_degree": p.data_parallel_shard_degree,
               "tensor_parallel_degree": p.tensor_parallel_degree,
               "pipeline_parallel_degree": p.pipeline_parallel_degree,
               "pipeline_parallel_virtual_stages": p.pipeline_parallel_virtual_stages,
               "pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
               "pipeline_parallel_num_microbatches": p.pipeline_parallel_num_microbatches}
    problems += [f"{name} must be >= 1, got {value}" for name, value in degrees.items() if value < 1]
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage must be 0-3, got {p.zero_stage}")
    elif p.zero_stage == 0 and p.data_parallel_shard_degree > 1:
        problems.append(f"zero_stage 0 (DDP) replicates, but data_parallel_shard_degree is {p.data_parallel_shard_degree}")
    if p.pipeline_parallel_schedule not in SCHEDULES:
        problems.append(f"pipeline schedule {p.pipeline_parallel_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if p.activation_checkpoint not in RECOMPUTE:
        problems.append(f"activation_checkpoint {p.activation_checkpoint!r} is not one of {', '.join(RECOMPUTE)}")
    if p.tensor_parallel_degree > 1 and not plan.tensor_parallel_plan:
        problems.append(f"tensor_parallel_degree is {p.tensor_parallel_degree} but the plan's tensor_parallel_plan "
                        "names no Linear to shard")
    bad_styles = sorted(k for k, v in plan.tensor_parallel_plan.items() if v not in TENSOR_PARALLEL_STYLES)
    if bad_styles:
        problems.append(f"tensor_parallel_plan styles must be one of {TENSOR_PARALLEL_STYLES} "
                        f"({len(bad_styles)} entries are not)")
    if not problems:
        problems += _batch_and_stage_problems(plan)
    if problems:
        raise UserError("cannot generate train.py for this plan: " + "; ".join(problems))


def _batch_and_stage_problems(plan: Plan) -> list[str]:
    p, t = plan.parallelism, plan.training
    problems = []
    per_step = p.data_parallel_degree * p.pipeline_parallel_num_microbatches * p.pipeline_parallel_microbatch_size
    if t.global_batch_size != per_step:
        problems.append(f"global batch {t.global_batch_size} != dp {p.data_parallel_degree} x micro-batches "
                        f"{p.pipeline_parallel_num_microbatches} x micro-batch size "
                        f"{p.pipeline_parallel_microbatch_size} = {per_step}")
    pp, virtual, micro = p.pipeline_parallel_degree, p.pipeline_parallel_virtual_stages, p.pipeline_parallel_num_microbatches
    if virtual > 1 and (pp == 1 or p.pipeline_parallel_schedule != "interleaved"):
        problems.append(f"{virtual} virtual stages per rank need the interleaved schedule and pp > 1 "
                        f"(schedule {p.pipeline_parallel_schedule}, pp {pp})")
    if pp > 1 and len(plan.stages) != pp * virtual:
        problems.append(f"pipeline_parallel_degree {pp} x virtual stages {virtual} = {pp * virtual} stages, "
                        f"but the plan lists {len(plan.stages)}")
    if pp > 1 and any(not stage.modules for stage in plan.stages):
        problems.append("every pipeline stage must list at least one module")
    if pp > 1 and p.pipeline_parallel_schedule == "1f1b" and micro < pp:
        problems.append(f"1f1b needs at least as many micro-batches as stages: {micro} < {pp}")
    if pp > 1 and p.pipeline_parallel_schedule == "interleaved" and micro % pp:
        problems.append(f"interleaved 1f1b needs micro-batches in multiples of pp: {micro} % {pp} = {micro % pp}")
    return problems


def render_train_py(plan: Plan, launch: Launch) -> str:
    return TRAIN_PY.replace("__DOCSTRING__", _docstring(plan, launch)).replace("__CONFIG__", _config_block(plan))


def _docstring(plan: Plan, launch: Launch) -> str:
    """Numbers and fixed words only (never a user string: it could end the docstring)."""
    p = plan.parallelism
    lines = [
        "Distributed training program generated by autoplan.",
        "",
        f"Layout: {_layout(plan)}.",
        f"{p.world_size} processes; global batch {plan.training.global_batch_size} = data parallel "
        f"{p.data_parallel_degree} x {p.pipeline_parallel_num_microbatches} micro-batches x "
        f"{p.pipeline_parallel_microbatch_size} samples.",
        *_precision(plan.training.dtype),
        "",
    ]
    if launch.nnodes == 1:
        lines += ["Launch:", f"    {launch.command}"]
    else:
        lines += [f"Launch on each of the {launch.nnodes} nodes (MASTER_ADDR: a host name of node 0):",
                  f"    NNODES={launch.nnodes} MASTER_ADDR=<node 0 host> bash launch/torchrun.sh",
                  "which runs:", f"    {launch.command}"]
    lines += [
        "or on a cluster: sbatch launch/job.sbatch (SLURM), kubectl apply -f launch/trainjob.yaml",
        "(Kubeflow Trainer) or launch/pytorchjob.yaml (Kubeflow Training Operator v1).",
        "",
        "Data: the model file's make_dataloader(rank, world_size[, batch_size]) if it has one (shard",
        "with a DistributedSampler), else synthetic batches from its example_batch.",
        "Checkpoints: --checkpoint-dir DIR [--checkpoint-every N]; continue with --resume.",
        "",
        "Initial weights: every rank builds the model on the meta device and allocates only its own",
        "stages and shards; rank 0 builds the model once on CPU with the seed below and broadcasts",
        "the values (see autoplan/runtime/materialize.py for the trade-off).",
        "",
        "Check it on this machine's CPU (gloo) against a single-device run first:",
        "    autoplan verify .",
        "The single-device reference it compares against (same weights, batches and optimizer):",
        "    python train.py --reference --steps 3 --losses-out reference_losses.json",
    ]
    return "\n".join(lines) + "\n"


def _precision(dtype: str) -> list[str]:
    if dtype != "bf16":
        return ["Precision: fp32."]
    return ["Precision: bf16 mixed precision on GPUs (FSDP2's MixedPrecisionPolicy, else torch.autocast;",
            "fp32 weights, optimizer and gradient reduction). On CPU it trains in fp32: that is what",
            "`autoplan verify` compares with the single-device run."]


def _layout(plan: Plan) -> str:
    p = plan.parallelism
    dp = p.data_parallel_degree
    parts = []
    if dp > 1 and p.zero_stage == 0:
        parts.append(f"{dp}-way data parallel (DDP)")
    elif dp > 1:
        hybrid = " (HSDP)" if p.data_parallel_replicate_degree > 1 and p.data_parallel_shard_degree > 1 else ""
        parts.append(f"{dp}-way data parallel with FSDP2, zero {p.zero_stage}{hybrid}: replicate "
                     f"{p.data_parallel_replicate_degree} x shard {p.data_parallel_shard_degree}")
    if p.tensor_parallel_degree > 1:
        parts.append(f"{p.tensor_parallel_degree}-way tensor parallel ({len(plan.tensor_parallel_plan)} Linears)")
    if p.pipeline_parallel_degree > 1:
        virtual = (f", {p.pipeline_parallel_virtual_stages} stages per rank"
                   if p.pipeline_parallel_virtual_stages > 1 else "")
        parts.append(f"{p.pipeline_parallel_degree}-rank pipeline ({p.pipeline_parallel_schedule}{virtual})")
    if p.activation_checkpoint != "none":
        parts.append(f"{p.activation_checkpoint} activation checkpointing")
    return ", ".join(parts) if parts else "one process"


def _peak_flops_per_gpu(plan: Plan) -> float | None:
    """Dense peak FLOP/s of the planned GPU in the planned dtype (for MFU), from its hardware
    profile, else from the plan's own prediction (mfu = flops / (time x gpus x peak))."""
    from autoplan.hardware.profiles import load_hardware

    try:
        peak = load_hardware(plan.cluster.gpu).gpu.peak_flops.get(plan.training.dtype)
    except UserError:
        peak = None
    if peak:
        return float(peak)
    pred = plan.predicted
    if pred.mfu > 0 and pred.step_time_s > 0 and plan.cluster.num_gpus > 0:
        return pred.model_flops_per_step / (pred.mfu * pred.step_time_s * plan.cluster.num_gpus)
    return None


def _config_block(plan: Plan) -> str:
    p, t = plan.parallelism, plan.training
    rows = [
        ("MODEL_SOURCE", repr(plan.model.path), "the planned model file (its imports and paths work there)"),
        ("MODEL_FILE", 'Path(MODEL_SOURCE) if Path(MODEL_SOURCE).is_file() else Path(__file__).with_name("model.py")',
         "else the copy beside this file"),
        ("FACTORY", repr(plan.model.factory), "function in model.py that builds the model"),
        ("SEED", repr(t.seed), "weights: manual_seed(SEED); step t's batch: SEED + 1000 + t"),
        ("LEARNING_RATE", repr(t.learning_rate), "AdamW"),
        ("GLOBAL_BATCH", repr(t.global_batch_size), "samples per optimizer step, all ranks together"),
        ("DTYPE", repr(t.dtype), '"bf16": mixed precision on GPUs (fp32 on CPU)'),
        ("DP_REPLICATE", repr(p.data_parallel_replicate_degree), "data-parallel replicas (DDP, or HSDP's replicate dim)"),
        ("DP_SHARD", repr(p.data_parallel_shard_degree), "data-parallel ranks sharding the model (FSDP2)"),
        ("ZERO_STAGE", repr(p.zero_stage), "0 = DDP; 3 = FSDP2 resharding after forward; 1/2 = FSDP2 keeping params gathered"),
        ("TP", repr(p.tensor_parallel_degree), "tensor-parallel ranks (innermost mesh dim)"),
        ("PP", repr(p.pipeline_parallel_degree), "pipeline ranks"),
        ("VIRTUAL_STAGES", repr(p.pipeline_parallel_virtual_stages), "stages per pipeline rank (interleaved schedule)"),
        ("SCHEDULE", repr(p.pipeline_parallel_schedule), "pipeline schedule"),
        ("MICROBATCH_SIZE", repr(p.pipeline_parallel_microbatch_size), "samples per micro-batch"),
        ("NUM_MICROBATCHES", repr(p.pipeline_parallel_num_microbatches), "micro-batches per step per data-parallel rank"),
        ("ACTIVATION_CHECKPOINT", repr(p.activation_checkpoint), "none | selective (keep matmul outputs) | full"),
        ("TOKENS_PER_SAMPLE", repr(t.tokens_per_sample), "for tokens/s (None: not token inputs)"),
        ("MODEL_FLOPS_PER_STEP", repr(float(plan.predicted.model_flops_per_step)), "for MFU"),
        ("PEAK_FLOPS_PER_GPU", repr(_peak_flops_per_gpu(plan)), f"dense peak of the planned GPU in {t.dtype}, for MFU"),
    ]
    width = 34  # aligns the comments; a longer line just pushes its comment right
    lines = [f"{f'{name} = {value}':<{width}}  # {comment}" for name, value, comment in rows]
    lines += _literal_block("TENSOR_PARALLEL_PLAN", "{}", [f"{fqn!r}: {style!r}," for fqn, style in
                                                           plan.tensor_parallel_plan.items()],
                            "nn.Linear FQN -> colwise | rowwise (when TP > 1)")
    lines += _literal_block("RECOMPUTE_MODULES", "[]", [f"{unit!r}," for unit in plan.activation_checkpoint_modules],
                            "units to recompute (empty: every unit, unless ACTIVATION_CHECKPOINT is none)")
    lines.append("STAGES = [  # the modules (units) each pipeline stage runs, in order; stage s on pipeline rank s % PP")
    lines += [f"    {list(stage.modules)!r}," for stage in sorted(plan.stages, key=lambda s: s.index)]
    lines.append("]")
    return "\n".join(lines)


def _literal_block(name: str, brackets: str, entries: list[str], comment: str) -> list[str]:
    """NAME = {...} one entry per line (or NAME = {} when empty), with its comment."""
    if not entries:
        return [f"{f'{name} = {brackets}':<34}  # {comment}"]
    return [f"{name} = {brackets[0]}  # {comment}", *(f"    {entry}" for entry in entries), brackets[1]]
