"""Launchers: how many nodes and processes per node a plan needs, and the files in launch/:
torchrun.sh (one node, or every node of a c10d rendezvous), job.sbatch (SLURM), Dockerfile (the image
the Kubernetes manifests run), trainjob.yaml (Kubeflow Trainer) and pytorchjob.yaml (the Kubeflow
Training Operator's PyTorchJob), written by codegen/kubernetes.py.

What only the user knows (the image, the partition or account, paths) is a variable with a default at
the top of each file. Only numbers from the plan enter the files, never a name or a path, so no plan
can change their structure; the manifests are parsed back and checked.

Every launcher checkpoints periodically (checkpoint_interval: the steps between saves, from the plan's
predicted step time and checkpoint size) and restarts on its own: torchrun's --max-restarts, SLURM's
requeue, the pods' restart policy; a restart resumes from the newest checkpoint (--resume). The images
and pods run as a non-root user and pass the "restricted" Pod Security Standard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.cost.memory import FSDP2_STATE_BYTES_PER_PARAM
from autoplan.errors import UserError
from autoplan.plan import Plan

JOB_NAME = "autoplan-train"
"""SLURM job name and the prefix of Kubernetes job names (generateName adds a unique suffix)."""
IMAGE = "autoplan-train:latest"
"""Default image name: what `docker build -t` in launch/Dockerfile's header makes."""
BASE_IMAGE = "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"
"""The Dockerfile's default base: an official PyTorch CUDA image (torch >= 2.6, what autoplan needs)."""
WORKDIR = "/workspace/autoplan_out"
"""Where the image holds this output folder."""
RDZV_PORT = 29500
CPUS_PER_PROCESS = 8
"""CPU cores asked for per training process (data loading, the host side of the step)."""
MEMORY_PER_PROCESS_GIB = 16
"""Host memory asked for per process (Kubernetes requests): rank 0 builds the whole model on CPU once."""
SHM_PER_PROCESS_GIB = 2
"""/dev/shm per process in the pods (NCCL and DataLoader workers; container runtimes default to 64 MiB)."""
STEPS = 1000
"""Default --steps of the cluster launchers (train.py's own default, 10, is a smoke test)."""
TIME_LIMIT = "01:00:00"
"""Default SLURM wall-clock limit."""
MAX_RESTARTS = 3
"""Default restarts after a failure (torchrun --max-restarts, the PyTorchJob's backoffLimit): a lost rank or a
transient network error recovers, a bug in the program stops after MAX_RESTARTS + 1 tries."""
REQUEUE_SIGNAL_S = 300
"""SLURM signals the batch script this many seconds before the time limit (--signal=B:USR1@...); the script
passes the signal on to train.py, which saves a checkpoint at the next step and stops, and then requeues the job,
which resumes from that checkpoint. 5 minutes: a step and a save (see CheckpointInterval) should fit in it."""
USER_ID = 10001
"""The non-root user (and its group) the image runs as and the pods ask for (runAsUser, fsGroup): above the
IDs distributions give their own users (Ubuntu images have uid 1000, `ubuntu`), so useradd never collides."""
USER_NAME = "autoplan"

TARGET_CHECKPOINT_INTERVAL_S = 1800.0
"""Training time between periodic checkpoints: a killed or preempted job loses at most about this much
(30 minutes, issue 30)."""
MAX_SAVE_FRACTION = 0.03
"""The most of the training time that saving may take: train.py saves synchronously (runtime/components/checkpoint.py,
dcp.save), every rank waits for the save, so a save of S seconds needs an interval of at least S / 0.03."""
NODE_WRITE_BYTES_PER_S = 1e9
"""Bytes per second one node writes its share of a checkpoint at: a 10 GbE link to a shared filesystem
(1.25e9 B/s line rate, IEEE 802.3ae) less protocol overhead. Every rank writes its own shards (DCP), so the
nodes write in parallel. Parallel filesystems write faster: then the save costs less than assumed and the
interval stays at TARGET_CHECKPOINT_INTERVAL_S."""
CHECKPOINT_BYTES_PER_PARAM = FSDP2_STATE_BYTES_PER_PARAM["parameters"] + FSDP2_STATE_BYTES_PER_PARAM["optimizer"]
"""What a checkpoint holds per parameter (runtime/components/checkpoint.py saves the model and AdamW state): the fp32
weight and AdamW's fp32 exp_avg and exp_avg_sq, 4 + 8 = 12 bytes, whatever the training dtype (cost/memory.py)."""


@dataclass(frozen=True)
class CheckpointInterval:
    """Steps between periodic checkpoints (train.py --checkpoint-every), and the numbers they come from."""

    steps: int
    step_time_s: float
    """The plan's predicted step time."""
    checkpoint_bytes: float
    nodes: int
    save_s: float
    """Predicted seconds one save takes: checkpoint_bytes / (nodes x NODE_WRITE_BYTES_PER_S)."""
    interval_s: float
    """Training seconds wanted between saves: max(TARGET_CHECKPOINT_INTERVAL_S, save_s / MAX_SAVE_FRACTION)."""

    def comment(self, prefix: str = "# ") -> str:
        """Comment lines for a launch file: the interval, its formula and its inputs."""
        rate_gb = NODE_WRITE_BYTES_PER_S / 1e9
        lines = [
            f"Periodic checkpoints every {self.steps} steps (CHECKPOINT_EVERY, train.py --checkpoint-every; 0: at",
            "the end only): a killed, preempted or requeued job loses at most that much training. From the plan:",
            f"  steps = ceil(interval / predicted step time) = ceil({self.interval_s:.0f} s / {self.step_time_s:g} s)"
            f" = {self.steps}",
            f"  interval = max({TARGET_CHECKPOINT_INTERVAL_S:.0f} s, save time / {MAX_SAVE_FRACTION:g}) = "
            f"max({TARGET_CHECKPOINT_INTERVAL_S:.0f} s, {self.save_s:.1f} s / {MAX_SAVE_FRACTION:g}) = "
            f"{self.interval_s:.0f} s",
            f"    (30 minutes of training, or longer where saving, which every rank waits for, would cost more "
            f"than {MAX_SAVE_FRACTION:.0%} of it)",
            f"  save time = checkpoint size / (nodes x {rate_gb:g} GB/s written per node) = "
            f"{self.checkpoint_bytes / 1e9:.1f} GB / ({self.nodes} x {rate_gb:g} GB/s) = {self.save_s:.1f} s",
            f"  checkpoint size = {CHECKPOINT_BYTES_PER_PARAM} bytes x parameters (fp32 weights, AdamW's two fp32 moments)",
        ]
        return "".join(f"{prefix}{line}\n" for line in lines)


def checkpoint_interval(step_time_s: float, param_count: int, nodes: int) -> CheckpointInterval:
    """Steps between periodic checkpoints: about TARGET_CHECKPOINT_INTERVAL_S of training, and never so
    often that saving takes more than MAX_SAVE_FRACTION of it:
        save_s = CHECKPOINT_BYTES_PER_PARAM x param_count / (nodes x NODE_WRITE_BYTES_PER_S)
        interval_s = max(TARGET_CHECKPOINT_INTERVAL_S, save_s / MAX_SAVE_FRACTION), in whole seconds
        steps = max(1, ceil(interval_s / step_time_s))"""
    if not step_time_s > 0:
        raise UserError(f"the plan's predicted step time must be positive to size the checkpoint interval, "
                        f"it is {step_time_s} s")
    checkpoint_bytes = float(CHECKPOINT_BYTES_PER_PARAM * param_count)
    save_s = checkpoint_bytes / (max(1, nodes) * NODE_WRITE_BYTES_PER_S)
    interval_s = float(math.ceil(max(TARGET_CHECKPOINT_INTERVAL_S, save_s / MAX_SAVE_FRACTION)))  # whole seconds
    steps = math.ceil(interval_s / step_time_s * (1 - 1e-12))  # a rounding error adds no step
    return CheckpointInterval(steps=max(1, steps), step_time_s=step_time_s,
                              checkpoint_bytes=checkpoint_bytes, nodes=max(1, nodes), save_s=save_s,
                              interval_s=interval_s)


@dataclass(frozen=True)
class Launch:
    """How torchrun starts the plan's processes."""

    nnodes: int
    """Nodes (machines)."""
    nproc_per_node: int
    """Processes (GPUs) per node."""
    checkpoint: CheckpointInterval
    """How often the launchers (and train.py by default) save a checkpoint."""
    world_arithmetic: str = ""
    """The plan's processes as their factors ("pp 1 x dp_replicate 2 x ... = 2 processes", Parallelism.world_size_arithmetic),
    for the launchers' messages ("": the world size alone)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def command(self) -> str:
        """The torchrun command (single node) or the one every node runs (several nodes)."""
        if self.nnodes == 1:
            return f"torchrun --standalone --nproc-per-node {self.nproc_per_node} train.py"
        return (f"torchrun --nnodes {self.nnodes} --nproc-per-node {self.nproc_per_node} --rdzv-backend c10d "
                f"--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id $RDZV_ID train.py")


def launch_layout(plan: Plan) -> Launch:
    world = plan.parallelism.world_size
    per_node = max(1, plan.cluster.gpus_per_node)
    if world <= per_node:
        nnodes, nproc_per_node = 1, world
    elif world % per_node:
        raise UserError(f"{world} processes do not fill whole nodes of {per_node} GPUs "
                        f"({world} / {per_node} = {world / per_node:.2f} nodes)")
    else:
        nnodes, nproc_per_node = world // per_node, per_node
    return Launch(nnodes=nnodes, nproc_per_node=nproc_per_node,
                  checkpoint=checkpoint_interval(plan.predicted.step_time_s, plan.model.param_count, nnodes),
                  world_arithmetic=plan.parallelism.world_size_arithmetic())


def rank0_output(folder: str) -> str:
    """Comment lines: where rank 0's output lands (any node: the rendezvous assigns the ranks)."""
    return (f"# Rank 0 prints the losses and writes --losses-out/--metrics-out (relative to {folder}); the\n"
            f"# rendezvous places it on any node, so give those flags a path on a filesystem every node shares.\n")


FRESH_STORE = (
    "# A fresh store for each restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: train.py's rank 0 hosts it):\n"
    "# by default torchrun hands its rendezvous store on from one attempt to the next, and on CPU (gloo) the\n"
    "# restarted processes then read the killed ones' addresses from it (\"Gloo connectFullMesh failed ...\n"
    "# Connection refused\", issue 30). Measured with torch 2.13 on CPU: without it the first restarts failed\n"
    "# so, with it the first restart resumed. Not tried on NCCL.\n"
    'export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"\n')
"""The lines of the launch files that restart (torchrun.sh, job.sbatch) which make the gloo restart work."""


def torchrun_script(launch: Launch) -> str:
    n, per = launch.nnodes, launch.nproc_per_node
    flags = "[torchrun flags --] [train.py flags, e.g. --steps 100]"
    if n == 1:
        usage = (f"# On one node with {per} GPU{'s' if per > 1 else ''}, from anywhere:\n"
                 f"#   bash launch/torchrun.sh {flags}\n")
        run_id = "${RUN_ID:-$(date -u +%Y%m%d-%H%M%S)-$$}"
        run_id_comment = "a new folder per run"
    else:
        usage = (f"# This plan needs {n} nodes of {per} GPUs. Run this on each of the {n} nodes, with the same\n"
                 f"# MASTER_ADDR (a host name of one of them that all can reach: it hosts the c10d rendezvous)\n"
                 f"# and the same RDZV_ID, new for each run (it also names the run's checkpoint folder):\n"
                 f"#   NNODES={n} MASTER_ADDR=node1.example MASTER_PORT={RDZV_PORT} RDZV_ID=run1 bash launch/torchrun.sh {flags}\n"
                 f"# torchrun's c10d rendezvous assigns the node ranks.\n"
                 f"# All {launch.world_size} processes on one node with {launch.world_size} GPUs instead:\n"
                 f"#   NNODES=1 NPROC_PER_NODE={launch.world_size} bash launch/torchrun.sh {flags}\n")
        run_id = "${RUN_ID:-${RDZV_ID:-$(date -u +%Y%m%d-%H%M%S)-$$}}"
        run_id_comment = "RDZV_ID on several nodes, the same on each"
    return f"""#!/usr/bin/env bash
# Launch train.py with torchrun. Generated by autoplan.
#
{usage}# Flags before a `--` go to torchrun (e.g. --max-restarts 5 --), all others to train.py.
{rank0_output("the output folder")}#
# Restarts: when a process fails, torchrun restarts all of them, up to MAX_RESTARTS times
# (--max-restarts); the restarted train.py resumes from the newest checkpoint in CHECKPOINT_DIR on its own
# (its --resume is on when torchrun's TORCHELASTIC_RESTART_COUNT is above 0). A new run starts from step 0
# in a new CHECKPOINT_DIR; to continue an earlier run, pass --checkpoint-dir DIR --resume.
#
{launch.checkpoint.comment()}set -euo pipefail
cd "$(dirname "$0")/.."

# ---- settings (environment variables override these defaults) ----
NNODES="${{NNODES:-{n}}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-{per}}}"
MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"
MAX_RESTARTS="${{MAX_RESTARTS:-{MAX_RESTARTS}}}"  # torchrun restarts the processes this many times at most
CHECKPOINT_EVERY="${{CHECKPOINT_EVERY:-{launch.checkpoint.steps}}}"  # steps between checkpoints (0: at the end only)
RUN_ID="{run_id}"  # {run_id_comment}
CHECKPOINT_DIR="${{CHECKPOINT_DIR:-checkpoints/$RUN_ID}}"  # relative to the output folder
{FRESH_STORE}
# the plan's processes, all of them: one line and exit 2 before torchrun starts (and restarts) any other number
if [ "$((NNODES * NPROC_PER_NODE))" -ne {launch.world_size} ]; then
    echo "launch/torchrun.sh: error: NNODES x NPROC_PER_NODE = $NNODES x $NPROC_PER_NODE = $((NNODES * NPROC_PER_NODE)) processes, but the plan is for {launch.world_arithmetic or f'{launch.world_size} processes'}" >&2
    exit 2
fi

# torchrun's flags: those before a `--`; train.py's: the rest (all of them without a `--`)
TORCHRUN_FLAGS=()
TRAIN_FLAGS=("$@")
for ((i = 1; i <= $#; i++)); do
    if [ "${{!i}}" = "--" ]; then
        TORCHRUN_FLAGS=("${{@:1:i - 1}}")
        TRAIN_FLAGS=("${{@:i + 1}}")
        break
    fi
done
TRAIN=(train.py --checkpoint-dir "$CHECKPOINT_DIR" --checkpoint-every "$CHECKPOINT_EVERY" "${{TRAIN_FLAGS[@]}}")

if [ "$NNODES" -eq 1 ]; then
    exec torchrun --standalone --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" \\
        "${{TORCHRUN_FLAGS[@]}}" "${{TRAIN[@]}}"
fi
: "${{MASTER_ADDR:?set MASTER_ADDR to a host name of one of the $NNODES nodes (the rendezvous endpoint), the same on every node}}"
: "${{RDZV_ID:?set RDZV_ID to a name for this run, the same on every node and new for each run}}"
exec torchrun \\
    --nnodes "$NNODES" \\
    --nproc-per-node "$NPROC_PER_NODE" \\
    --rdzv-backend c10d \\
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
    --rdzv-id "$RDZV_ID" \\
    --max-restarts "$MAX_RESTARTS" \\
    "${{TORCHRUN_FLAGS[@]}}" \\
    "${{TRAIN[@]}}"
"""


def sbatch_script(launch: Launch) -> str:
    n, per = launch.nnodes, launch.nproc_per_node
    cpus = CPUS_PER_PROCESS * per
    interval = launch.checkpoint.comment()
    return f"""#!/bin/bash
# SLURM job for train.py on {n} node{'s' if n > 1 else ''} x {per} GPU{'s' if per > 1 else ''}. Generated by autoplan.
# Submit from the output folder (the one holding train.py and launch/):
#   sbatch launch/job.sbatch [train.py flags, e.g. --steps 100]
# Partition and account: sbatch -p PARTITION -A ACCOUNT launch/job.sbatch (or SBATCH_PARTITION and
# SBATCH_ACCOUNT in the environment); without them SLURM uses your defaults. Other #SBATCH values can be
# overridden the same way (e.g. --time). The log, %x-%j.out in the folder you submit from, holds every
# node's output, rank 0's losses too (appended across requeues).
#
# Each job checkpoints into its own folder, CHECKPOINT_DIR, and resumes from the newest checkpoint there
# (--resume) whenever it starts again:
# - a failed process: torchrun restarts all of them, up to MAX_RESTARTS times, in the allocation;
# - the time limit: {REQUEUE_SIGNAL_S} s before it SLURM signals this script (--signal=B:USR1), which passes the
#   signal on to train.py (it saves a checkpoint at the next step and stops) and then requeues the job
#   (scontrol requeue); the requeued job keeps its id, so its checkpoint folder, and continues from there;
# - a failed node: SLURM requeues the job (--requeue).
# Training done since the newest checkpoint is lost (at most CHECKPOINT_EVERY steps).
#
{interval}#
# The compute nodes need a Python environment with torch and autoplan, on a filesystem they share:
#   python -m venv ~/autoplan-venv && ~/autoplan-venv/bin/pip install torch /path/to/autoplan-source
#SBATCH --job-name={JOB_NAME}
#SBATCH --nodes={n}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per}
#SBATCH --cpus-per-task={cpus}
#SBATCH --time={TIME_LIMIT}
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@{REQUEUE_SIGNAL_S}
set -euo pipefail

# ---- settings (environment variables at submission override these defaults) ----
VENV="${{VENV:-$HOME/autoplan-venv}}"  # the environment with torch and autoplan (see above)
OUT_DIR="${{OUT_DIR:-$SLURM_SUBMIT_DIR}}"  # the output folder (train.py, model_code/, launch/)
CHECKPOINT_DIR="${{CHECKPOINT_DIR:-$OUT_DIR/checkpoints/$SLURM_JOB_ID}}"
STEPS="${{STEPS:-{STEPS}}}"
CHECKPOINT_EVERY="${{CHECKPOINT_EVERY:-{launch.checkpoint.steps}}}"  # steps between checkpoints (0: at the end only)
MAX_RESTARTS="${{MAX_RESTARTS:-{MAX_RESTARTS}}}"  # torchrun restarts the processes this many times at most
MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"

if [ ! -f "$OUT_DIR/train.py" ] && [ -f "$OUT_DIR/../train.py" ]; then
    OUT_DIR="$OUT_DIR/.."  # submitted from launch/
fi
if [ ! -f "$OUT_DIR/train.py" ]; then
    echo "job.sbatch: no train.py in $OUT_DIR: submit from the output folder or set OUT_DIR" >&2
    exit 2
fi
if [ ! -f "$VENV/bin/activate" ]; then
    echo "job.sbatch: no Python environment at $VENV: create it (see this file's header) or set VENV" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$VENV/bin/activate"
cd "$OUT_DIR"

# the first node of the allocation hosts the c10d rendezvous; rank 0 may land on any node
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # no pipe to head: SIGPIPE under pipefail
export MASTER_ADDR="${{NODES[0]}}" MASTER_PORT
export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / {per} > 0 ? SLURM_CPUS_PER_TASK / {per} : 1 ))

# What srun runs on each node: torchrun with USR1 ignored (torchrun does not pass USR1 on, and its default action
# would end torchrun), and a trap that hands USR1 to torchrun's children, the training processes (in sessions of
# their own, which a signal to the task does not reach); they save a checkpoint at the next step and exit 0.
# A USR1 that comes while they start (before train.py's handler is set) is lost: the job then ends at its limit.
# shellcheck disable=SC2016  # expanded by the bash that srun starts on each node
NODE_RUN='trap "" USR1; torchrun "$@" & agent=$!; trap "pkill -USR1 -P $agent" USR1
status=0; wait "$agent" || status=$?
while kill -0 "$agent" 2>/dev/null; do status=0; wait "$agent" || status=$?; done
exit "$status"'

# shellcheck disable=SC2317  # run by the USR1 trap
save_and_requeue() {{
    echo "job.sbatch: the time limit is near: train.py saves a checkpoint and stops (USR1), then job" \\
         "$SLURM_JOB_ID is requeued and resumes from $CHECKPOINT_DIR" >&2
    kill -USR1 "$TRAIN_PID" 2>/dev/null || true  # srun passes it on to every node's NODE_RUN
    wait "$TRAIN_PID" || true  # the save, then the processes' exit
    scontrol requeue "$SLURM_JOB_ID"
    REQUEUED=1
}}
trap save_and_requeue USR1

{FRESH_STORE}
# since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: pass it on, and bind the task to them.
# In the background: bash runs the USR1 trap only between commands, and `wait` is one it leaves for a signal.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --cpu-bind=cores --kill-on-bad-exit=1 bash -c "$NODE_RUN" node-run \\
    --nnodes "$SLURM_NNODES" \\
    --nproc-per-node {per} \\
    --rdzv-backend c10d \\
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
    --rdzv-id "$SLURM_JOB_ID" \\
    --max-restarts "$MAX_RESTARTS" \\
    train.py --steps "$STEPS" --checkpoint-dir "$CHECKPOINT_DIR" --checkpoint-every "$CHECKPOINT_EVERY" --resume "$@" &
TRAIN_PID=$!
status=0
wait "$TRAIN_PID" || status=$?
if [ -n "${{REQUEUED:-}}" ]; then
    exit 0  # saved, stopped and requeued (save_and_requeue)
fi
exit "$status"
"""


def dockerfile() -> str:
    return f"""# syntax=docker/dockerfile:1
# The image the Kubernetes manifests run: an official PyTorch CUDA image, autoplan installed from its
# source, and this output folder at {WORKDIR}. Generated by autoplan. Build it from the output folder
# (BuildKit, Docker 23 or later), naming where autoplan's source is (a checkout of its repository):
#   docker build --build-context autoplan-source=/path/to/autoplan-source -f launch/Dockerfile -t {IMAGE} .
# then push it to a registry your cluster pulls from and set that name in the manifests.
# It runs as the non-root user {USER_NAME} (uid and gid {USER_ID}, what the manifests' runAsUser, runAsGroup
# and fsGroup name), who owns the output folder; root only installs.
ARG BASE_IMAGE={BASE_IMAGE}
FROM ${{BASE_IMAGE}}

COPY --from=autoplan-source . /opt/autoplan-source
RUN python -m pip install --no-cache-dir /opt/autoplan-source && python -c "import autoplan.runtime"
RUN groupadd --gid {USER_ID} {USER_NAME} && useradd --uid {USER_ID} --gid {USER_ID} --create-home {USER_NAME}

COPY --chown={USER_ID}:{USER_ID} . {WORKDIR}
WORKDIR {WORKDIR}
USER {USER_ID}:{USER_ID}
"""
