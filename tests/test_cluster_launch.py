"""The generated launchers run as written: launch/torchrun.sh as two torchrun agents (NNODES=2, a c10d
rendezvous on 127.0.0.1), and launch/job.sbatch under bash with stand-in `srun` and `scontrol` (srun
starts its command once per node with the SLURM_* variables sbatch and srun set), on a plan of 2
nodes x 1 CPU process. Both train, and their losses match the single-device reference as
`autoplan verify` requires. torchrun.sh restarts a rank killed after the first periodic checkpoint, and
the restart resumes on its own with the uninterrupted run's losses."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from autoplan.verify import PARITY_TOLERANCE, REFERENCE_COMMAND, run_args
from test_codegen import MLP

pytestmark = pytest.mark.slow  # runs of 2 torchrun agents, a reference, a killed and restarted run (~1-4 min)

STEPS = 3
TIMEOUT_S = 300

SRUN = """#!/bin/bash
# stand-in srun: drop its options, start the command once per node as srun would, wait for all
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
# stand-in scontrol: `scontrol show hostnames LIST` prints one host per node
[ "$1 $2" = "show hostnames" ] || exit 1
for _ in $(seq 1 "$SLURM_NNODES"); do echo 127.0.0.1; done
"""
ACTIVATE = """# stand-in venv: the Python running the tests, and the stand-in srun/scontrol
export PATH="{bin}:{python_bin}:$PATH"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(commands: list[list[str]], cwd: Path, envs: list[dict]) -> list[subprocess.CompletedProcess]:
    """Run the commands at once, each in its own process group; kill them all on a timeout."""
    procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, start_new_session=True) for command, env in zip(commands, envs)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


TORCHRUN = f"""#!/bin/bash
# torchrun of the Python running the tests (a venv over system packages has no torchrun script of its own)
exec {sys.executable} -m torch.distributed.run "$@"
"""


def python_bin(tmp: Path) -> Path:
    """A folder with `python` and `torchrun` of the interpreter running the tests."""
    folder = tmp / "python_bin"
    folder.mkdir(exist_ok=True)
    (folder / "torchrun").write_text(TORCHRUN)
    (folder / "torchrun").chmod(0o755)
    if not (folder / "python").exists():
        (folder / "python").symlink_to(sys.executable)
    return folder


def child_env(tmp: Path, **extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env["PATH"] = f"{python_bin(tmp)}:{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def two_node_plan(tmp_path_factory):
    """A 2-node plan (1 CPU process per node) and its single-device reference losses."""
    out = tmp_path_factory.mktemp("two_nodes")
    plan = plan_model(str(MLP), 2, "cpu", PlanOptions(gpus_per_node=1, pin="dp=2", out=out)).plan
    assert (plan.cluster.gpus_per_node, plan.parallelism.world_size) == (1, 2)
    reference = out / "reference_losses.json"
    done = subprocess.run([*REFERENCE_COMMAND, "train.py", "--", *run_args(STEPS), "--losses-out", str(reference)],
                          cwd=out, env=child_env(tmp_path_factory.mktemp("reference")), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return out, json.loads(reference.read_text())


def assert_parity(losses_file: Path, reference: list[float], runs: list[subprocess.CompletedProcess]):
    assert all(r.returncode == 0 for r in runs), "\n".join(r.stderr[-3000:] for r in runs)
    losses = json.loads(losses_file.read_text())
    assert len(losses) == len(reference) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= PARITY_TOLERANCE, (losses, reference)


def test_torchrun_sh_as_two_agents_trains_like_the_reference(two_node_plan, tmp_path):
    out, reference = two_node_plan
    assert "NNODES=\"${NNODES:-2}\"" in (out / "launch" / "torchrun.sh").read_text()
    losses = tmp_path / "losses.json"
    env = child_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="two-agents")
    command = ["bash", str(out / "launch" / "torchrun.sh"), *run_args(STEPS), "--losses-out", str(losses)]
    runs = run([command, command], tmp_path, [env, env])  # from another folder: the script finds its own
    assert_parity(losses, reference, runs)


def test_sbatch_script_with_stand_in_srun_trains_like_the_reference(two_node_plan, tmp_path):
    out, reference = two_node_plan
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    for folder in (bin_dir, venv / "bin"):
        folder.mkdir(parents=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(ACTIVATE.format(bin=bin_dir, python_bin=python_bin(tmp_path)))
    losses = tmp_path / "losses.json"
    env = {**child_env(tmp_path), "VENV": str(venv), "MASTER_PORT": str(free_port()), "STEPS": "1000",
           # what sbatch sets for `sbatch launch/job.sbatch` submitted from the output folder
           "SLURM_SUBMIT_DIR": str(out), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "2", "SLURM_JOB_NAME": "autoplan-train"}
    env["PATH"] = "/usr/bin:/bin"  # torchrun and python come from the venv's activate
    runs = run([["bash", str(out / "launch" / "job.sbatch"), *run_args(STEPS), "--losses-out", str(losses)]],
               tmp_path, [env])
    assert_parity(losses, reference, runs)
    assert sorted(p.name for p in (out / "checkpoints" / "4242").iterdir()) == [f"step_{STEPS}"]


RESTART_STEPS = 600
RESTART_EVERY = 50


def worker_pids(agent: int) -> list[int]:
    """The train.py processes torchrun (process `agent`) started: its children whose command line names train.py."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        if parent == agent and any(part.endswith(b"train.py") for part in command):
            found.append(int(entry.name))
    return sorted(found)


def test_torchrun_sh_restarts_a_killed_rank_and_the_restart_resumes_on_its_own(two_node_plan, tmp_path):
    """kill -9 of one rank after the first periodic checkpoint: torchrun.sh's --max-restarts starts the
    processes again, train.py resumes from the newest checkpoint without being asked (--resume is on after a
    torchrun restart), and the steps it trains after the restart have the uninterrupted run's losses."""
    out, _ = two_node_plan
    flags = [*run_args(RESTART_STEPS), "--checkpoint-every", str(RESTART_EVERY)]
    one_node = dict(NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    whole = tmp_path / "whole.json"
    command = ["bash", str(out / "launch" / "torchrun.sh"), *flags, "--losses-out", str(whole)]
    (done,) = run([command], tmp_path, [child_env(tmp_path, RUN_ID="whole", **one_node)])
    assert done.returncode == 0, done.stderr[-3000:]

    losses, metrics = tmp_path / "resumed.json", tmp_path / "metrics.json"
    command = ["bash", str(out / "launch" / "torchrun.sh"), *flags, "--losses-out", str(losses),
               "--metrics-out", str(metrics)]
    env = child_env(tmp_path, RUN_ID="killed", MAX_RESTARTS="3", **one_node)
    agent = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    first_checkpoint = out / "checkpoints" / "killed" / f"step_{RESTART_EVERY}" / ".metadata"
    try:
        while not first_checkpoint.exists() and agent.poll() is None:
            time.sleep(0.01)
        victims = worker_pids(agent.pid)
        assert len(victims) == 2, (victims, agent.poll())
        os.kill(victims[-1], signal.SIGKILL)
        stdout, stderr = agent.communicate(timeout=TIMEOUT_S)
    finally:
        if agent.poll() is None:  # torchrun starts each worker in a session of its own: kill them one by one
            for pid in worker_pids(agent.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, stderr[-3000:]
    first_step = json.loads(metrics.read_text())["first_step"]
    assert first_step > 0 and first_step % RESTART_EVERY == 0, first_step  # it resumed, from a checkpoint
    resumed, uninterrupted = json.loads(losses.read_text()), json.loads(whole.read_text())
    assert len(resumed) == RESTART_STEPS - first_step
    assert resumed == uninterrupted[first_step:]


FORWARDING_SRUN = """#!/bin/bash
# stand-in srun: as SRUN, and it passes USR1 on to each node's command, as srun forwards signals to its tasks
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
trap 'kill -USR1 "${pids[@]}"' USR1
status=0
for pid in "${pids[@]}"; do
    code=0; wait "$pid" || code=$?
    while kill -0 "$pid" 2>/dev/null; do code=0; wait "$pid" || code=$?; done  # a wait the trap cut short
    [ "$code" -eq 0 ] || status=$code
done
exit $status
"""
LOGGING_SCONTROL = SCONTROL.replace('[ "$1 $2" = "show hostnames" ] || exit 1',
                                    'echo "$@" >> "{log}"\n[ "$1" = requeue ] && exit 0\n'
                                    '[ "$1 $2" = "show hostnames" ] || exit 1')
USR1_STEPS = 5000


def test_sbatch_on_usr1_saves_a_checkpoint_stops_and_requeues_and_the_requeued_job_loses_nothing(two_node_plan,
                                                                                                  tmp_path):
    """SLURM's warning before the time limit (USR1 to the batch script): job.sbatch passes it on to train.py
    (through srun and each node's torchrun), whose ranks save a checkpoint at the next step and exit 0; then the
    script requeues the job. The requeued job (the same script, job id and checkpoint folder) resumes there."""
    out, _ = two_node_plan
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    for folder in (bin_dir, venv / "bin"):
        folder.mkdir(parents=True)
    log = tmp_path / "scontrol.log"
    for name, text in (("srun", FORWARDING_SRUN), ("scontrol", LOGGING_SCONTROL.format(log=log))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(ACTIVATE.format(bin=bin_dir, python_bin=python_bin(tmp_path)))
    env = {**child_env(tmp_path), "VENV": str(venv), "MASTER_PORT": str(free_port()), "CHECKPOINT_EVERY": "0",
           "SLURM_SUBMIT_DIR": str(out), "SLURM_JOB_ID": "5151", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "2", "SLURM_JOB_NAME": "autoplan-train", "PATH": "/usr/bin:/bin"}
    losses, metrics = tmp_path / "losses.json", tmp_path / "metrics.json"
    command = ["bash", str(out / "launch" / "job.sbatch"), "--device", "cpu", "--losses-out", str(losses)]
    job = subprocess.Popen(command, cwd=tmp_path, env={**env, "STEPS": str(USR1_STEPS)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while job.poll() is None and not (losses.exists() and len(json.loads(losses.read_text() or "[]")) >= 2):
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what SLURM sends the batch script (--signal=B:USR1@300)
        stdout, stderr = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr[-3000:]
    trained = len(json.loads(losses.read_text()))
    assert 2 <= trained < USR1_STEPS
    assert sorted(p.name for p in (out / "checkpoints" / "5151").iterdir()) == [f"step_{trained}"]
    assert f"USR1: saved {out / 'checkpoints' / '5151' / f'step_{trained}'} after {trained} steps" in stdout, stdout
    assert log.read_text().splitlines()[-1] == "requeue 5151"

    requeued = subprocess.run(command[:-1] + [str(tmp_path / "requeued.json"), "--metrics-out", str(metrics)],
                              cwd=tmp_path, env={**env, "STEPS": str(trained + 2), "MASTER_PORT": str(free_port())},
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert json.loads(metrics.read_text())["first_step"] == trained
    assert len(json.loads((tmp_path / "requeued.json").read_text())) == 2


def test_a_checkpoint_that_loads_nowhere_ends_train_py_in_one_line_and_exit_2(two_node_plan, tmp_path):
    """Both ranks of train.py (started as torchrun starts them) find only checkpoints that do not load (one of
    another model, one damaged): one line naming each and why, exit code 2, no traceback."""
    import torch
    from torch import nn

    from autoplan.runtime.components.checkpoint import Checkpointer

    out, _ = two_node_plan
    other = nn.Linear(3, 2)  # not the plan's model
    checkpointer = Checkpointer(tmp_path / "checkpoints", other, torch.optim.AdamW(other.parameters()))
    for step in (1, 2):
        checkpointer.save(step)
    for shard in (tmp_path / "checkpoints" / "step_2").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])
    port = str(free_port())
    envs = [child_env(tmp_path, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port) for r in range(2)]
    command = [sys.executable, "train.py", "--device", "cpu", "--steps", "4", "--checkpoint-dir",
               str(tmp_path / "checkpoints"), "--resume"]
    runs = run([command, command], out, envs)
    assert [r.returncode for r in runs] == [2, 2], runs[0].stderr[-3000:]
    assert not any("Traceback" in r.stderr for r in runs), runs[0].stderr[-3000:]
    (line,) = [line for line in runs[0].stderr.splitlines() if line.startswith("train.py:")]
    assert line.startswith(f"train.py: resume: none of the 2 checkpoints in {tmp_path / 'checkpoints'} loads: "
                           "step_2 did not load ("), line
    assert "; step_1 did not load (" in line and "Missing key" in line, line
    assert runs[1].stderr.count("train.py:") == 0  # said once, by rank 0
