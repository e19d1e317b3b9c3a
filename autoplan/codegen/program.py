"""Write the training program for a plan: train.py, a copy of the model file (with the local modules it
imports) in model_code/, launch/.

Every value from the plan enters train.py as a Python literal made by repr() (module names, the
factory name, paths can be any string), and the docstring holds only numbers and fixed words, so
no plan or file name can change what the program does.
"""

from __future__ import annotations

import shutil
from dataclasses import fields
from pathlib import Path

from autoplan.codegen.kubernetes import pytorchjob_yaml, trainjob_yaml
from autoplan.codegen.launch import Launch, dockerfile, launch_layout, sbatch_script, torchrun_script
from autoplan.codegen.template import fill
from autoplan.errors import UserError
from autoplan.layout import SCHEDULE_BY_NAME, SCHEDULES, SUPPORTED, TENSOR_PARALLEL_STYLES, Parallelism
from autoplan.plan import Plan
from autoplan.contract import import_root, local_files

MODEL_COPY_DIR = "model_code"
"""The output folder's copy of the model file and the local modules and packages it imports, at their paths
from its import root (source.import_root): `wrapper.py` beside `model.py` becomes model_code/wrapper.py and
model_code/model.py, so the copy imports what the original did (and no name of the user's collides with
train.py or plan.json)."""


def write_program(plan: Plan, out_dir: Path, model_file: Path) -> None:
    """Write out_dir/train.py, out_dir/model_code/ (copy_model_files) and out_dir/launch/."""
    check_supported(plan)
    launch = launch_layout(plan)
    model_file = Path(model_file)
    if not model_file.is_file():
        raise UserError(f"model file not found: {model_file}")
    out_dir = Path(out_dir)
    (out_dir / "launch").mkdir(parents=True, exist_ok=True)
    copied = copy_model_files(model_file, out_dir / MODEL_COPY_DIR)
    (out_dir / "train.py").write_text(render_train_py(plan, launch, copied))
    for name, text in launcher_files(launch).items():
        (out_dir / "launch" / name).write_text(text)
    for script in ("torchrun.sh", "job.sbatch"):
        (out_dir / "launch" / script).chmod(0o755)


def copy_model_files(model_file: Path, folder: Path) -> Path:
    """Copy the model file and the local files it imports (source.local_files) into `folder`, each at its
    path from the import root; the model file's path there, relative to `folder`."""
    model_file = Path(model_file).resolve()
    root = import_root(model_file)
    for file in local_files(model_file):
        target = folder / file.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)
    return model_file.relative_to(root)


def find_model_copy(out_dir: Path, planned: str | Path) -> Path:
    """The path of the model file's copy in out_dir/model_code/ (copy_model_files): of the copied files named
    as the planned one (`planned`: its absolute path, plan.json model.path), the one whose path in the copy ends that path the longest
    way (a package's model.py beside a file model.py at the import root is told apart so). A UserError if the
    folder holds no copy."""
    name, planned = Path(planned).name, Path(planned).parts
    folder = Path(out_dir) / MODEL_COPY_DIR
    found = [f for f in folder.rglob(name) if f.is_file()] if folder.is_dir() else []
    ends = [f for f in found if planned[-len(f.relative_to(folder).parts):] == f.relative_to(folder).parts]
    if not ends:
        raise UserError(f"{folder} holds no copy of {name}: is {out_dir} an autoplan output "
                        f"folder? (give the model file with --model)")
    return max(ends, key=lambda f: len(f.relative_to(folder).parts))


def launcher_files(launch: Launch) -> dict[str, str]:
    """File name in launch/ -> contents."""
    return {"torchrun.sh": torchrun_script(launch), "job.sbatch": sbatch_script(launch), "Dockerfile": dockerfile(),
            "trainjob.yaml": trainjob_yaml(launch), "pytorchjob.yaml": pytorchjob_yaml(launch)}


def check_supported(plan: Plan) -> None:
    """Reject plans the generated program cannot run (layout.problems with what codegen supports), with
    the numbers that conflict."""
    found = plan.problems(SUPPORTED)
    bad_styles = sorted(k for k, v in plan.tensor_parallel_plan.items() if v not in TENSOR_PARALLEL_STYLES)
    if bad_styles:
        found.append(f"tensor_parallel_plan styles must be one of {TENSOR_PARALLEL_STYLES} "
                     f"({len(bad_styles)} entries are not)")
    if found:
        raise UserError("cannot generate train.py for this plan: " + "; ".join(found))


def render_train_py(plan: Plan, launch: Launch, model_copy: Path | None = None) -> str:
    """The text of train.py for `plan`: the template codegen/templates/train.py with this plan's docstring
    and config block in place of its own (codegen/template.py). `model_copy`: the model file's path in
    MODEL_COPY_DIR (default: its name, a file outside packages)."""
    model_copy = model_copy if model_copy is not None else Path(Path(plan.model.path).name)
    return fill(_docstring(plan, launch), _config_block(plan, launch, model_copy))


def _docstring(plan: Plan, launch: Launch) -> str:
    """Numbers and fixed words only (never a user string: it could end the docstring)."""
    p = plan.parallelism
    lines = [
        "Distributed training program generated by autoplan.",
        "",
        f"Layout: {_layout(plan)}.",
        f"{p.world_size} processes; global batch {plan.training.global_batch_size} = data parallel "
        f"{p.dp} x {p.microbatches} micro-batches x "
        f"{p.microbatch} samples.",
        *_precision(plan.training.dtype),
        "",
    ]
    if launch.nnodes == 1:
        lines += ["Launch:", f"    {launch.command}"]
    else:
        lines += [f"Launch on each of the {launch.nnodes} nodes, with the same MASTER_ADDR (a host name of one",
                  "of them that all can reach: it hosts the c10d rendezvous) and RDZV_ID (new for each run):",
                  f"    NNODES={launch.nnodes} MASTER_ADDR=<that host> RDZV_ID=<run name> bash launch/torchrun.sh",
                  "which runs:", f"    {launch.command}",
                  "The rendezvous assigns the ranks: rank 0, which prints the losses and writes --losses-out and",
                  "--metrics-out, can land on any node."]
    lines += [
        "On a cluster, from this folder: sbatch launch/job.sbatch (SLURM), or build launch/Dockerfile and",
        "kubectl create -f launch/trainjob.yaml (Kubeflow Trainer v2.2+) or launch/pytorchjob.yaml",
        "(Kubeflow Training Operator v1.7+). Set the values at the top of each file first.",
        "",
        f"Model: MODEL_FILE in {MODEL_COPY_DIR}/ beside this file, the copy made at planning of the model file",
        "and of the modules beside it that it imports (--model-file planned imports the file it was",
        "planned from instead, MODEL_SOURCE, with the edits made there since).",
        "",
        "Data: the model file's make_dataloader(rank, world_size[, batch_size]) if it has one (shard",
        "with a DistributedSampler), else synthetic batches from its example_batch.",
        f"Checkpoints: --checkpoint-dir DIR saves every CHECKPOINT_EVERY = {launch.checkpoint.steps} steps (about",
        f"{launch.checkpoint.interval_s / 60:.0f} minutes of predicted steps; --checkpoint-every N, 0: at the end only) and",
        "after the last; continue with --resume (on by default when torchrun restarts the processes).",
        "",
        "Initial weights: every rank builds the model on the meta device and allocates only its own",
        "stages and shards; rank 0 builds the model once on CPU with the seed below and broadcasts",
        "the values (see autoplan/runtime/distributed/materialize.py for the trade-off).",
        "",
        "Check it on this machine's CPU (gloo) against a single-device run first (same weights, batches,",
        "optimizer and schedule; loss and every first-step gradient compared):",
        "    autoplan verify .",
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
    dp = p.dp
    parts = []
    facts = SCHEDULE_BY_NAME.get(p.schedule)
    if dp > 1 and not p.fsdp_enabled and p.pp > 1 and facts is not None and facts.split_backward:
        parts.append(f"{dp}-way data parallel (each stage averages its gradients over the replicas after its last "
                     f"weight-gradient pass; no DDP)")
    elif dp > 1 and not p.fsdp_enabled:
        parts.append(f"{dp}-way data parallel (DDP)")
    elif dp > 1:
        hybrid = " (HSDP)" if p.dp_replicate > 1 else ""
        parts.append(f"{dp}-way data parallel with FSDP2{hybrid}: dp_replicate {p.dp_replicate} x "
                     f"dp_shard {p.dp_shard}, reshard {p.layout().reshard}")
    if p.tp > 1:
        sequence = ", sequence parallel" if p.sp else ""
        split = sum(style in ("colwise", "rowwise") for style in plan.tensor_parallel_plan.values())
        parts.append(f"{p.tp}-way tensor parallel ({split} Linears{sequence})")
    if p.cp > 1:
        parts.append(f"{p.cp}-way context parallel (ring attention over SDPA, FSDP2 over "
                     f"dp_shard {p.dp_shard} x cp {p.cp})")
    if p.ep > 1:
        parts.append(f"{p.ep}-way expert parallel (the experts split over groups of "
                     f"{p.ep} of the dp_shard x cp x tp ranks, all-to-all token dispatch)")
    if p.pp > 1:
        per_rank = (f", {p.virtual_stages} stages per rank"
                    if p.virtual_stages > 1 else "")
        parts.append(f"{p.pp}-rank pipeline ({p.schedule}{per_rank})")
    if p.recompute != "none":
        parts.append(f"{p.recompute} activation checkpointing")
    if p.offload:
        parts.append("CPU offload")
    if plan.compile.enable:
        parts.append("torch.compile per module")
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


MIN_PROCESS_GROUP_TIMEOUT_S = 1800.0
"""The shortest collective timeout train.py gets (runtime/distributed/mesh.py PROCESS_GROUP_TIMEOUT_S, 30 minutes: torch's
NCCL default is 10)."""
BUILD_BYTES_PER_S = 1e8
"""fp32 bytes per second rank 0 builds and initializes the model at on the CPU while the other ranks wait in the
first broadcast: nn.Linear and nn.Embedding initialize at 0.13-0.14 GB/s on one thread of this project's VM
(torchrun gives each rank OMP_NUM_THREADS=1), rounded down."""
BUILD_TIME_MARGIN = 2.0
"""The timeout is this many times the estimated build (a slower host, the model's own init code, the broadcast)."""


def process_group_timeout_s(param_count: int) -> float:
    """Seconds train.py's collectives wait before failing: at least MIN_PROCESS_GROUP_TIMEOUT_S, and
    BUILD_TIME_MARGIN x the time rank 0 takes to build `param_count` fp32 parameters (BUILD_BYTES_PER_S): the
    other ranks wait that long in the first collective. Llama-3-70B: 2 x 4 x 70.6e9 / 1e8 = 5,600 s."""
    return max(MIN_PROCESS_GROUP_TIMEOUT_S, round(BUILD_TIME_MARGIN * 4 * param_count / BUILD_BYTES_PER_S))


PREDICTED_KEYS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes")
"""plan.json predicted values that train.py's PREDICTED carries (what runtime.TensorBoardLog draws beside the
measured ones), by their plan.json names."""


def _predicted(plan: Plan) -> dict[str, float]:
    """PREDICTED_KEYS of the plan's prediction, those it has (tokens_per_s is None when inputs are not tokens)."""
    values = {key: getattr(plan.predicted, key) for key in PREDICTED_KEYS}
    return {key: float(value) for key, value in values.items() if value is not None}


LAYOUT_COMMENTS = {
    "dp_replicate": "data-parallel replicas (DDP, or HSDP's replicate dim)",
    "dp_shard": "data-parallel ranks sharding the model (FSDP2)",
    "reshard": "FSDP2 frees gathered parameters after forward (ZeRO-3)",
    "tp": "tensor-parallel ranks (innermost mesh dim)",
    "pp": "pipeline ranks (outermost mesh dim)",
    "schedule": "pipeline schedule: " + " | ".join(SCHEDULES),
    "microbatch": "samples per micro-batch",
    "microbatches": "micro-batches per step per data-parallel rank",
    "recompute": "activation checkpointing: none | selective (keep matmul outputs) | full",
    "virtual_stages": "stages per pipeline rank (interleaved and zero-bubble schedules)",
    "sp": "sequence parallel between the TP pairs (when TP > 1)",
    "loss_parallel": "cross-entropy on the vocabulary-sharded logits (TP head)",
    "offload": "FSDP2 CPU offload: model states in host memory, AdamW on the CPU",
    "cp": "context-parallel ranks: each a share of every sequence (ring attention)",
    "ep": "expert-parallel ranks, folded over dp_shard x cp x tp (groups of EP split the experts)",
}
"""The comment beside each of train.py's layout constants, by Parallelism field (docs/layouts.md has the long
meanings)."""


def layout_constants(parallelism: Parallelism) -> list[tuple[str, str, str]]:
    """train.py's layout constants, the one codec from a Parallelism to them: (name, Python literal, comment) for each
    field, in the field order; the name is the short name upper case (DP_SHARD, MICROBATCHES), the literal the
    field's value (True/False for reshard, sp, loss_parallel and offload). train.py's parallel_config passes each back
    to the field of its name."""
    return [(f.name.upper(), repr(getattr(parallelism, f.name)), LAYOUT_COMMENTS[f.name])
            for f in fields(Parallelism)]


def _config_block(plan: Plan, launch: Launch, model_copy: Path) -> str:
    t = plan.training
    rows = [
        ("MODEL_SOURCE", repr(plan.model.path), "the file it was planned from (used with --model-file planned)"),
        ("PLAN_FINGERPRINT", repr(plan.fingerprint()), "plan.json's fingerprint: runs beside no other plan (--plan)"),
        ("MODEL_FILE", f"Path(__file__).parent / {MODEL_COPY_DIR!r} / {model_copy.as_posix()!r}",
         "the copy made at planning: what trains by default"),
        ("FACTORY", repr(plan.model.factory), "function in the model file that builds the model"),
        ("SEED", repr(t.seed), "weights: manual_seed(SEED); step t's batch: SEED + 1000 + t"),
        ("LEARNING_RATE", repr(t.learning_rate), "AdamW"),
        ("OPTIMIZER_IMPLEMENTATION", repr(t.optimizer_implementation), "AdamW kernels: fused | foreach | for-loop"),
        ("GLOBAL_BATCH", repr(t.global_batch_size), "samples per optimizer step, all ranks together"),
        ("DTYPE", repr(t.dtype), '"bf16": mixed precision on GPUs (fp32 on CPU)'),
        *layout_constants(plan.parallelism),
        ("COMPILE", repr(plan.compile.enable), "torch.compile per chain module (train.py --compile/--no-compile)"),
        ("TOKENS_PER_SAMPLE", repr(t.tokens_per_sample), "for tokens/s (None: not token inputs)"),
        ("MODEL_FLOPS_PER_STEP", repr(float(plan.predicted.model_flops_per_step)), "for MFU"),
        ("PEAK_FLOPS_PER_GPU", repr(_peak_flops_per_gpu(plan)), f"dense peak of the planned GPU in {t.dtype}, for MFU"),
        ("PROCESS_GROUP_TIMEOUT_S", repr(float(process_group_timeout_s(plan.model.param_count))),
         "collective timeout, seconds: rank 0 builds the model while the others wait (--process-group-timeout)"),
        ("CHECKPOINT_EVERY", repr(launch.checkpoint.steps),
         f"--checkpoint-every default: ~{launch.checkpoint.interval_s / 60:.0f} min of predicted steps (launch/*: how)"),
    ]
    width = 34  # aligns the comments; a longer line just pushes its comment right
    lines = [f"{f'{name} = {value}':<{width}}  # {comment}" for name, value, comment in rows]
    lines += _literal_block("PREDICTED", "{}", [f"{key!r}: {value!r}," for key, value in _predicted(plan).items()],
                            "plan.json predicted: --tensorboard logs them beside the measured values")
    lines += _literal_block("TENSOR_PARALLEL_PLAN", "{}", [f"{fqn!r}: {style!r}," for fqn, style in
                                                           plan.tensor_parallel_plan.items()],
                            "nn.Linear FQN -> colwise | rowwise; replicate: a per-head norm between them (when TP > 1)")
    lines += _literal_block("RECOMPUTE_MODULES", "[]", [f"{name!r}," for name in plan.activation_checkpoint_modules],
                            "the modules recomputed in backward, in the RECOMPUTE mode")
    lines += _literal_block("BATCH_NORM_MODULES", "[]", [f"{name!r}," for name in plan.batch_norm_modules],
                            "BatchNorm modules: statistics synchronized over the DP ranks")
    lines.append("STAGES = [  # the modules each pipeline stage runs, in order; stage s on pipeline rank s % PP "
                 "(a V: zbv, dualpipev)")
    lines += [f"    {list(stage.modules)!r}," for stage in sorted(plan.stages, key=lambda s: s.index)]
    lines.append("]")
    return "\n".join(lines)


def _literal_block(name: str, brackets: str, entries: list[str], comment: str) -> list[str]:
    """NAME = {...} one entry per line (or NAME = {} when empty), with its comment."""
    if not entries:
        return [f"{f'{name} = {brackets}':<34}  # {comment}"]
    return [f"{name} = {brackets[0]}  # {comment}", *(f"    {entry}" for entry in entries), brackets[1]]
