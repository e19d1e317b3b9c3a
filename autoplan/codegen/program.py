"""Write the training program for a plan: train.py, a copy of the model file, launch/torchrun.sh.

Every value from the plan enters train.py as a Python literal made by repr() (module names, the
factory name, paths can be any string), and the docstring holds only numbers and fixed words, so
no plan or file name can change what the program does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from autoplan.codegen.launch import Launch, launch_layout, torchrun_script
from autoplan.codegen.train_template import TRAIN_PY
from autoplan.errors import UserError
from autoplan.plan import Plan

SUPPORTED_SCHEDULES = ("gpipe", "1f1b")
SUPPORTED_RECOMPUTE = ("none", "full")


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
    script = out_dir / "launch" / "torchrun.sh"
    script.write_text(torchrun_script(launch))
    script.chmod(0o755)


def check_supported(plan: Plan) -> None:
    """Reject layouts the generated program cannot run yet, with the numbers that conflict."""
    p, t = plan.parallelism, plan.training
    problems = []
    if p.tensor_parallel_degree > 1:
        problems.append(f"tensor parallelism (tp={p.tensor_parallel_degree}) is not generated yet")
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule not in SUPPORTED_SCHEDULES:
        problems.append(f"pipeline schedule {p.pipeline_parallel_schedule!r} is not generated yet "
                        f"(supported: {', '.join(SUPPORTED_SCHEDULES)})")
    if p.pipeline_parallel_virtual_stages > 1:
        problems.append(f"{p.pipeline_parallel_virtual_stages} virtual stages per rank need the interleaved "
                        "schedule, not generated yet")
    if p.activation_checkpoint not in SUPPORTED_RECOMPUTE:
        problems.append(f"activation_checkpoint {p.activation_checkpoint!r} is not generated yet (supported: none, full)")
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage must be 0-3, got {p.zero_stage}")
    elif p.zero_stage == 0 and p.data_parallel_shard_degree > 1:
        problems.append(f"zero_stage 0 (DDP) replicates, but data_parallel_shard_degree is {p.data_parallel_shard_degree}")
    degrees = {"data_parallel_replicate_degree": p.data_parallel_replicate_degree,
               "data_parallel_shard_degree": p.data_parallel_shard_degree,
               "pipeline_parallel_degree": p.pipeline_parallel_degree,
               "pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
               "pipeline_parallel_num_microbatches": p.pipeline_parallel_num_microbatches}
    problems += [f"{name} must be >= 1, got {value}" for name, value in degrees.items() if value < 1]
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
    pp = p.pipeline_parallel_degree
    if pp > 1 and len(plan.stages) != pp:
        problems.append(f"pipeline_parallel_degree is {pp} but the plan lists {len(plan.stages)} stages")
    if pp > 1 and any(not stage.modules for stage in plan.stages):
        problems.append("every pipeline stage must list at least one module")
    if pp > 1 and p.pipeline_parallel_schedule == "1f1b" and p.pipeline_parallel_num_microbatches < pp:
        problems.append(f"1f1b needs at least as many micro-batches as stages: {p.pipeline_parallel_num_microbatches} < {pp}")
    return problems


def render_train_py(plan: Plan, launch: Launch) -> str:
    return TRAIN_PY.replace("__DOCSTRING__", _docstring(plan, launch)).replace("__CONFIG__", _config_block(plan))


def _docstring(plan: Plan, launch: Launch) -> str:
    """Numbers and fixed words only (never a user string: it could end the docstring)."""
    p = plan.parallelism
    dp = p.data_parallel_degree
    if dp == 1:
        data = "no data parallelism"
    elif p.zero_stage == 0:
        data = f"{dp}-way data parallel (DDP)"
    else:
        data = (f"{dp}-way data parallel (FSDP2, zero {p.zero_stage}, replicate "
                f"{p.data_parallel_replicate_degree} x shard {p.data_parallel_shard_degree})")
    if p.pipeline_parallel_degree > 1:
        pipe = (f"{p.pipeline_parallel_degree}-stage pipeline ({p.pipeline_parallel_schedule}, "
                f"{p.pipeline_parallel_num_microbatches} micro-batches of {p.pipeline_parallel_microbatch_size} per step)")
    else:
        pipe = (f"no pipeline, {p.pipeline_parallel_num_microbatches} accumulated micro-batch(es) of "
                f"{p.pipeline_parallel_microbatch_size} per step")
    recompute = ", full activation checkpointing" if p.activation_checkpoint == "full" else ""
    lines = [
        "Distributed training program generated by autoplan.",
        "",
        f"Layout: {data} x {pipe}{recompute}; {p.world_size} processes,",
        f"global batch {plan.training.global_batch_size}.",
        "",
    ]
    if launch.nnodes == 1:
        lines += ["Launch:", f"    {launch.command}"]
    else:
        lines += [f"Launch on each of the {launch.nnodes} nodes (MASTER_ADDR: a host name of node 0):",
                  f"    NNODES={launch.nnodes} MASTER_ADDR=<node 0 host> bash launch/torchrun.sh",
                  "which runs:", f"    {launch.command}"]
    lines += [
        "",
        "Check it on this machine's CPU (gloo) against a single-device run first:",
        "    autoplan verify .",
        "The single-device reference it compares against (same weights, batches and optimizer):",
        "    python train.py --reference --steps 3 --losses-out reference_losses.json",
    ]
    return "\n".join(lines) + "\n"


def _config_block(plan: Plan) -> str:
    p, t = plan.parallelism, plan.training
    rows = [
        ("MODEL_FILE", 'Path(__file__).with_name("model.py")', "a copy of the planned model file"),
        ("MODEL_SOURCE", repr(plan.model.path), "where it was copied from"),
        ("FACTORY", repr(plan.model.factory), "function in model.py that builds the model"),
        ("SEED", repr(t.seed), "weights: manual_seed(SEED); step t's batch: SEED + 1000 + t"),
        ("LEARNING_RATE", repr(t.learning_rate), "AdamW"),
        ("GLOBAL_BATCH", repr(t.global_batch_size), "samples per optimizer step, all ranks together"),
        ("DP_REPLICATE", repr(p.data_parallel_replicate_degree), "data-parallel replicas (DDP, or HSDP's replicate dim)"),
        ("DP_SHARD", repr(p.data_parallel_shard_degree), "data-parallel ranks sharding the model (FSDP2)"),
        ("ZERO_STAGE", repr(p.zero_stage), "0 = DDP; 3 = FSDP2 resharding after forward; 1/2 = FSDP2 keeping params gathered"),
        ("PP", repr(p.pipeline_parallel_degree), "pipeline stages"),
        ("SCHEDULE", repr(p.pipeline_parallel_schedule), "pipeline schedule"),
        ("MICROBATCH_SIZE", repr(p.pipeline_parallel_microbatch_size), "samples per micro-batch"),
        ("NUM_MICROBATCHES", repr(p.pipeline_parallel_num_microbatches), "micro-batches per step per data-parallel rank"),
        ("ACTIVATION_CHECKPOINT", repr(p.activation_checkpoint), '"full": recompute each unit in backward'),
    ]
    width = 34  # aligns the comments; a longer line just pushes its comment right
    lines = [f"{f'{name} = {value}':<{width}}  # {comment}" for name, value, comment in rows]
    lines.append("STAGES = [  # the modules (units) each pipeline stage runs, in order")
    lines += [f"    {list(stage.modules)!r}," for stage in sorted(plan.stages, key=lambda s: s.index)]
    lines.append("]")
    return "\n".join(lines)
