"""The launchers in launch/: torchrun.sh and job.sbatch name the plan's node and process counts and pass
shellcheck; trainjob.yaml and pytorchjob.yaml load into the Kubeflow SDKs' own models with no unknown
key; the Dockerfile builds the image the manifests expect; a 2-node plan's files give no one-node
instruction; train.py imports the shipped copy of the model unless asked for the planned file. Every
launcher and train.py checkpoint at the plan's interval; torchrun.sh restarts (and splits its flags at
`--`), job.sbatch requeues itself before the time limit, train.py resumes after a torchrun restart; the
image runs as a non-root user and the manifests pass the restricted Pod Security Standard
(helpers/pod_security.py). test_cluster_launch.py runs the scripts."""

import contextlib
import importlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import replace

import pytest
import yaml

from autoplan.codegen import write_program
from autoplan.codegen.kubernetes import check_manifest, pytorchjob_yaml, trainjob_yaml
from autoplan.codegen.launch import BASE_IMAGE, WORKDIR, Launch, checkpoint_interval
from autoplan.errors import UserError
from autoplan.plan import ModelRef
from autoplan.runtime.harness.reference import run_reference
from helpers import pod_security
from test_codegen import MLP, load_module, make_plan


def need(what: str, install: str):
    """Skip with the install line when an optional tool is absent; fail instead in CI, which installs it."""
    message = f"{what} is not installed: {install} (.ci/run installs it)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def shellcheck() -> str:
    return shutil.which("shellcheck") or need("shellcheck", "apt-get install -y shellcheck")


def kube_models():
    """tests/helpers/kube_models.py, once both Kubeflow SDKs import."""
    for module, package in (("kubeflow_trainer_api", "kubeflow-trainer-api"), ("kubeflow.training", "kubeflow-training")):
        try:
            importlib.import_module(module)
        except ImportError:
            need(package, 'pip install -e ".[test]"')
    from helpers import kube_models

    return kube_models


def sbatch_options(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", text, flags=re.M))


def manifests(folder) -> tuple[dict, dict]:
    return tuple(yaml.safe_load((folder / "launch" / name).read_text()) for name in ("trainjob.yaml", "pytorchjob.yaml"))


NODE_LAYOUTS = [(8, 1, 4), (2, 2, 2), (1, 4, 1)]
"""(GPUs per node, nodes, processes per node) of a 4-process plan."""


@pytest.mark.parametrize("gpus_per_node, nodes, per_node", NODE_LAYOUTS)
def test_launchers_name_the_node_and_process_counts(tmp_path, gpus_per_node, nodes, per_node):
    write_program(make_plan(gpus_per_node=gpus_per_node), tmp_path, MLP)  # 4 processes
    launch = tmp_path / "launch"
    assert sorted(p.name for p in launch.iterdir()) == [
        "Dockerfile", "job.sbatch", "pytorchjob.yaml", "torchrun.sh", "trainjob.yaml"]
    torchrun = (launch / "torchrun.sh").read_text()
    assert f'NNODES="${{NNODES:-{nodes}}}"' in torchrun and f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{per_node}}}"' in torchrun
    sbatch = (launch / "job.sbatch").read_text()
    options = sbatch_options(sbatch)
    assert options["nodes"] == str(nodes) and options["gpus-per-node"] == str(per_node)
    assert options["ntasks-per-node"] == "1"  # one torchrun per node
    assert options["cpus-per-task"] == str(8 * per_node) and options["time"] == "01:00:00"
    assert 'srun --cpus-per-task="$SLURM_CPUS_PER_TASK"' in sbatch  # Slurm >= 22.05 does not pass it on
    assert f"--nproc-per-node {per_node}" in sbatch and '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in sbatch
    assert 'source "$VENV/bin/activate"' in sbatch
    assert ('train.py --steps "$STEPS" --checkpoint-dir "$CHECKPOINT_DIR" --checkpoint-every "$CHECKPOINT_EVERY" '
            '--resume "$@" &') in sbatch

    trainjob, job = manifests(tmp_path)
    assert trainjob["metadata"]["generateName"] == job["metadata"]["generateName"] == "autoplan-train-"
    trainer = trainjob["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, per_node)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == str(per_node)
    assert trainer["resourcesPerNode"]["requests"] == {"cpu": str(8 * per_node), "memory": f"{16 * per_node}Gi"}
    every = trainjob["metadata"]["annotations"]["autoplan/checkpoint-every"]
    assert trainer["args"] == ["--steps", "1000", "--checkpoint-dir", "/checkpoints/$(JOB_NAME)",
                               "--checkpoint-every", every, "--resume"]
    assert job["spec"]["nprocPerNode"] == str(per_node)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas.get("Worker", {}).get("replicas", 0) == nodes - 1
    pod = replicas["Master"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["torchrun", "--nproc-per-node", str(per_node), "train.py"]
    assert container["image"] == trainer["image"] == trainjob["metadata"]["annotations"]["autoplan/image"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{2 * per_node}Gi"}} in pod["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "autoplan-checkpoints"}} in pod["volumes"]


@pytest.mark.parametrize("gpus_per_node", [8, 2])
def test_shellcheck_finds_nothing_in_the_scripts(tmp_path, gpus_per_node):
    tool = shellcheck()
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\ncd $1\n")  # the check can fail: an unquoted variable
    assert "SC2086" in subprocess.run([tool, str(bad)], capture_output=True, text=True).stdout
    write_program(make_plan(gpus_per_node=gpus_per_node), tmp_path / "out", MLP)
    scripts = [str(tmp_path / "out" / "launch" / name) for name in ("torchrun.sh", "job.sbatch")]
    run = subprocess.run([tool, *scripts], capture_output=True, text=True)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")


@pytest.mark.parametrize("gpus_per_node", [8, 2, 1])
def test_manifests_load_into_the_kubeflow_sdk_models_with_no_unknown_key(tmp_path, gpus_per_node):
    models = kube_models()
    write_program(make_plan(gpus_per_node=gpus_per_node), tmp_path, MLP)
    launch = Launch(nnodes=4 // min(gpus_per_node, 4), nproc_per_node=min(gpus_per_node, 4),
                    checkpoint=checkpoint_interval(0.1, 0, 1))
    trainjob, job = manifests(tmp_path)
    loaded = models.load_trainjob(trainjob).spec
    assert (loaded.trainer.num_nodes, loaded.trainer.num_proc_per_node) == (launch.nnodes, launch.nproc_per_node)
    pod = loaded.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0].template.spec.template.spec
    assert [v.name for v in pod.volumes] == ["dshm", "checkpoints"] and pod.volumes[0].empty_dir.medium == "Memory"
    loaded = models.load_pytorchjob(job).spec
    assert loaded.nproc_per_node == str(launch.nproc_per_node)
    assert sum(spec.replicas for spec in loaded.pytorch_replica_specs.values()) == launch.nnodes
    container = loaded.pytorch_replica_specs["Master"].template.spec.containers[0]
    assert [m.mount_path for m in container.volume_mounts] == ["/dev/shm", "/checkpoints"]


@pytest.mark.parametrize("manifest, path, key", [
    (0, ("spec", "trainer"), "comand"),
    (0, ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template",
         "spec", "template", "spec", "volumes", 0, "emptyDir"), "sizelimit"),
    (1, ("spec",), "nProcPerNode"),
    (1, ("spec", "pytorchReplicaSpecs", "Master", "template", "spec", "containers", 0), "volumeMount"),
])
def test_a_misspelled_key_fails_the_sdk_check(tmp_path, manifest, path, key):
    models = kube_models()
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    data = manifests(tmp_path)[manifest]
    node = data
    for step in path:
        node = node[step]
    node[key] = node.get(key.lower(), "x") if isinstance(node, dict) else "x"
    load = (models.load_trainjob, models.load_pytorchjob)[manifest]
    with pytest.raises(AssertionError, match=re.escape(f".{key} (not a field of")):
        load(data)


def test_a_two_node_plan_gives_no_one_node_instruction(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)  # 2 nodes x 2 processes
    torchrun = (tmp_path / "launch" / "torchrun.sh").read_text()
    commands = re.findall(r"^#\s+(.*bash launch/torchrun\.sh.*)$", torchrun, flags=re.M)
    assert len(commands) == 2 and commands[0].startswith("NNODES=2 MASTER_ADDR=node1.example MASTER_PORT=29500 RDZV_ID=run1 bash")
    assert commands[1].startswith("NNODES=1 NPROC_PER_NODE=4 bash")  # all 4 on one node: the world train.py needs
    assert "One node" not in torchrun
    texts = [p.read_text() for p in (tmp_path / "launch").iterdir()] + [(tmp_path / "train.py").read_text()]
    for text in texts:
        assert "node 0" not in text and "kubectl apply" not in text and "torch-autoplan" not in text
    assert "rank 0" in torchrun.lower() and "can land on any node" in texts[-1]


def test_one_node_plan_says_how_to_run_on_one_node(tmp_path):
    write_program(make_plan(gpus_per_node=8), tmp_path, MLP)
    torchrun = (tmp_path / "launch" / "torchrun.sh").read_text()
    assert "# On one node with 4 GPUs, from anywhere:\n#   bash launch/torchrun.sh" in torchrun
    assert "MASTER_ADDR=node1" not in torchrun


def test_the_manifests_name_their_minimum_controller_versions(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    launch = tmp_path / "launch"
    assert "Needs Kubeflow Trainer v2.2 or later (spec.runtimePatches)" in (launch / "trainjob.yaml").read_text()
    assert "Needs the Kubeflow Training Operator v1.7 or later" in (launch / "pytorchjob.yaml").read_text()


def test_dockerfile_builds_the_image_the_manifests_run(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    lines = [line for line in (tmp_path / "launch" / "Dockerfile").read_text().splitlines()
             if line and not line.startswith("#")]
    assert lines[0] == f"ARG BASE_IMAGE={BASE_IMAGE}" and BASE_IMAGE.startswith("pytorch/pytorch:")
    assert "-cuda" in BASE_IMAGE and lines[1] == "FROM ${BASE_IMAGE}"
    assert "COPY --from=autoplan-source . /opt/autoplan-source" in lines
    assert any(line.startswith("RUN python -m pip install --no-cache-dir /opt/autoplan-source") for line in lines)
    assert lines[-3:] == [f"COPY --chown=10001:10001 . {WORKDIR}", f"WORKDIR {WORKDIR}", "USER 10001:10001"]
    trainjob, job = manifests(tmp_path)
    assert trainjob["spec"]["trainer"]["command"] == ["torchrun", f"{WORKDIR}/train.py"]
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["workingDir"] == WORKDIR


def test_train_py_trains_the_shipped_copy_unless_asked_for_the_planned_file(tmp_path):
    planned = tmp_path / "mine.py"
    shutil.copyfile(MLP, planned)
    plan = make_plan(dp_replicate=1, pp=1, stages=[["inp", "out"]],
                     microbatches=2, microbatch=8,
                     model=ModelRef(path=str(planned)))
    write_program(plan, tmp_path / "out", planned)
    planned.write_text(MLP.read_text() + "\n\ndef build_model():\n    raise RuntimeError('edited after planning')\n")
    program = load_module(tmp_path / "out" / "train.py", "generated_train_model_file")
    assert program.parse_args([]).model_file == "copy"
    train_py = tmp_path / "out" / "train.py"
    assert len(run_reference(train_py, ["--steps", "1", "--device", "cpu"])) == 1  # the program's load_model_source
    with pytest.raises(RuntimeError, match="edited after planning"):
        run_reference(train_py, ["--steps", "1", "--device", "cpu", "--model-file", "planned"])


def test_multi_node_torchrun_needs_the_rendezvous_host(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    script = (tmp_path / "launch" / "torchrun.sh").read_text()
    assert "--rdzv-backend c10d" in script and '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in script
    run = subprocess.run(["bash", str(tmp_path / "launch" / "torchrun.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "set MASTER_ADDR" in run.stderr


def test_sbatch_refuses_a_folder_without_train_py_in_one_line(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path / "out", MLP)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7"}
    run = subprocess.run(["bash", str(tmp_path / "out" / "launch" / "job.sbatch")], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 2
    assert run.stderr == f"job.sbatch: no train.py in {tmp_path}: submit from the output folder or set OUT_DIR\n"
    env["SLURM_SUBMIT_DIR"] = str(tmp_path / "out" / "launch")  # from launch/ it finds the folder; then the venv
    run = subprocess.run(["bash", str(tmp_path / "out" / "launch" / "job.sbatch")], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 2 and run.stderr.startswith(f"job.sbatch: no Python environment at {tmp_path}/autoplan-venv")


def test_uneven_nodes_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"4 processes do not fill whole nodes of 3 GPUs \(4 / 3 = 1.33 nodes\)"):
        write_program(make_plan(gpus_per_node=3), tmp_path, MLP)


@pytest.mark.parametrize("build, path, value", [
    (trainjob_yaml, ("spec", "trainer", "numNodes"), 3),
    (trainjob_yaml, ("spec", "runtimeRef", "name"), ""),
    (pytorchjob_yaml, ("spec", "nprocPerNode"), "8"),
    (pytorchjob_yaml, ("spec", "pytorchReplicaSpecs", "Master", "replicas"), 2),
])
def test_manifest_check_catches_wrong_counts_and_missing_fields(build, path, value):
    launch = Launch(nnodes=2, nproc_per_node=4, checkpoint=checkpoint_interval(0.1, 0, 2))
    manifest = yaml.safe_load(build(launch))
    check_manifest(manifest, launch)
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(AssertionError, match="generated manifest"):
        check_manifest(manifest, launch)


# ---- periodic checkpoints, restarts, least privilege (issue 30) ----

def big_plan(step_time_s: float, param_count: int, gpus_per_node: int = 2):
    """make_plan's 4-process plan with a model size and step time (2 nodes of 2 by default)."""
    plan = make_plan(gpus_per_node=gpus_per_node)
    return replace(plan, model=replace(plan.model, param_count=param_count),
                   predicted=replace(plan.predicted, step_time_s=step_time_s))


@pytest.mark.parametrize("step_time_s, param_count, nodes, steps, interval_s", [
    (0.1, 0, 2, 18000, 1800),  # nothing to save: 30 minutes of steps
    (2.0, 10 ** 9, 2, 900, 1800),  # 12 GB over 2 nodes at 1 GB/s: 6 s, 0.3% of 30 minutes
    (10.0, 10 ** 12, 8, 5000, 50000),  # 12 TB over 8 nodes: 1500 s a save, so 1500 / 0.03 s between saves
    (3600.0, 0, 1, 1, 1800),  # a step longer than the interval: every step
])
def test_checkpoint_interval_is_30_minutes_unless_saving_would_cost_over_3_percent(step_time_s, param_count, nodes,
                                                                                    steps, interval_s):
    interval = checkpoint_interval(step_time_s, param_count, nodes)
    assert (interval.steps, interval.interval_s) == (steps, interval_s)
    assert interval.save_s == 12 * param_count / (nodes * 1e9)
    assert interval.save_s <= 0.03 * interval.interval_s
    assert interval.steps * step_time_s >= min(interval.interval_s, step_time_s)
    comment = interval.comment()
    assert f"every {steps} steps" in comment and f"= {steps}\n" in comment and f"= {interval_s} s\n" in comment


def test_checkpoint_interval_refuses_a_step_time_it_cannot_divide_by():
    with pytest.raises(UserError, match="predicted step time must be positive .* it is 0.0 s"):
        checkpoint_interval(0.0, 10, 1)


def test_every_launcher_and_train_py_checkpoint_at_the_plans_interval(tmp_path):
    write_program(big_plan(step_time_s=2.0, param_count=10 ** 12), tmp_path, MLP)  # 6000 s a save: 200,000 s apart
    expected = checkpoint_interval(2.0, 10 ** 12, 2)
    assert (expected.steps, expected.interval_s) == (100000, 200000)
    every = str(expected.steps)
    launch = tmp_path / "launch"
    for script in ("torchrun.sh", "job.sbatch"):
        text = (launch / script).read_text()
        # a restart gets a fresh rendezvous store: on gloo the shared one fails the first restart (issue 30)
        assert 'export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"' in text
        assert f'CHECKPOINT_EVERY="${{CHECKPOINT_EVERY:-{every}}}"' in text
        assert '--checkpoint-every "$CHECKPOINT_EVERY"' in text
        assert expected.comment() in text  # the formula with its inputs
    trainjob, job = manifests(tmp_path)
    for manifest, name in ((trainjob, "trainjob.yaml"), (job, "pytorchjob.yaml")):
        assert manifest["metadata"]["annotations"]["autoplan/checkpoint-every"] == every
        assert expected.comment() in (launch / name).read_text()
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    for args in (trainjob["spec"]["trainer"]["args"], container["args"]):
        assert args[args.index("--checkpoint-every") + 1] == every and "--resume" in args
    program = load_module(tmp_path / "train.py", "generated_train_checkpoint_every")
    assert program.CHECKPOINT_EVERY == expected.steps
    assert program.parse_args([]).checkpoint_every == expected.steps
    assert program.parse_args(["--checkpoint-every", "0"]).checkpoint_every == 0  # at the end only, when asked


def test_train_py_resumes_on_its_own_when_torchrun_restarts_it(tmp_path, monkeypatch):
    write_program(make_plan(), tmp_path, MLP)
    program = load_module(tmp_path / "train.py", "generated_train_restart")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert program.parse_args(["--checkpoint-dir", "c"]).resume is False  # a first run starts at step 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert program.parse_args(["--checkpoint-dir", "c"]).resume is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert program.parse_args(["--checkpoint-dir", "c"]).resume is True  # torchrun restarted it
    assert program.parse_args([]).resume is False  # nothing to resume from, and no error
    assert program.parse_args(["--checkpoint-dir", "c", "--resume"]).resume is True


STUB_TORCHRUN = """#!/bin/bash
# stand-in torchrun: print its arguments, one a line
printf '%s\\n' "$@"
"""


def run_torchrun_sh(tmp_path, args: list[str], **env: str) -> list[str]:
    """launch/torchrun.sh's torchrun command line (a stand-in torchrun prints it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(STUB_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    run = subprocess.run(["bash", str(tmp_path / "out" / "launch" / "torchrun.sh"), *args], capture_output=True,
                         text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_torchrun_sh_restarts_and_gives_torchrun_the_flags_before_a_double_dash(tmp_path):
    write_program(make_plan(gpus_per_node=8), tmp_path / "out", MLP)  # one node of 4
    every = str(checkpoint_interval(0.1, 0, 1).steps)
    argv = run_torchrun_sh(tmp_path, ["--steps", "5"], RUN_ID="r1")
    assert argv == ["--standalone", "--nproc-per-node", "4", "--max-restarts", "3", "train.py", "--checkpoint-dir",
                    "checkpoints/r1", "--checkpoint-every", every, "--steps", "5"]
    argv = run_torchrun_sh(tmp_path, ["--max-restarts", "7", "--monitor-interval", "1", "--", "--steps", "5", "--",
                                      "x"], RUN_ID="r1", MAX_RESTARTS="2", CHECKPOINT_EVERY="0")
    train = argv.index("train.py")
    assert argv[:train] == ["--standalone", "--nproc-per-node", "4", "--max-restarts", "2", "--max-restarts", "7",
                            "--monitor-interval", "1"]  # torchrun keeps the last --max-restarts
    assert argv[train:] == ["train.py", "--checkpoint-dir", "checkpoints/r1", "--checkpoint-every", "0", "--steps",
                            "5", "--", "x"]  # only the first `--` splits
    first, second = (run_torchrun_sh(tmp_path, [])[6:8] for _ in range(2))
    assert first[0] == second[0] == "--checkpoint-dir" and first[1] != second[1]  # a new folder per run


def test_multi_node_torchrun_sh_names_its_checkpoints_after_the_rendezvous_id(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path / "out", MLP)  # 2 nodes of 2
    argv = run_torchrun_sh(tmp_path, ["--steps", "5"], MASTER_ADDR="h", RDZV_ID="run7")
    assert argv[argv.index("--rdzv-id") + 1] == "run7" and argv[argv.index("--max-restarts") + 1] == "3"
    assert argv[argv.index("train.py"):] == ["train.py", "--checkpoint-dir", "checkpoints/run7", "--checkpoint-every",
                                             str(checkpoint_interval(0.1, 0, 2).steps), "--steps", "5"]
    run = subprocess.run(["bash", str(tmp_path / "out" / "launch" / "torchrun.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "MASTER_ADDR": "h"})
    assert run.returncode != 0 and "set RDZV_ID to a name for this run" in run.stderr


SLEEPING_SRUN = """#!/bin/bash
# stand-in srun: say it started, then train for a long time
touch "{started}"
exec sleep 60
"""
LOGGING_SCONTROL = """#!/bin/bash
# stand-in scontrol: record the call
echo "$@" >> "{log}"
"""


def test_sbatch_requeues_itself_before_the_time_limit(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path / "out", MLP)
    text = (tmp_path / "out" / "launch" / "job.sbatch").read_text()
    options = sbatch_options(text)
    assert "requeue" in options and options["signal"] == "B:USR1@300" and options["open-mode"] == "append"
    assert '--max-restarts "$MAX_RESTARTS"' in text and "--resume" in text
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    bin_dir.mkdir()
    started, log = tmp_path / "started", tmp_path / "scontrol.log"
    (bin_dir / "srun").write_text(SLEEPING_SRUN.format(started=started))
    (bin_dir / "scontrol").write_text(LOGGING_SCONTROL.format(log=log))
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    (bin_dir / "scontrol").write_text(LOGGING_SCONTROL.format(log=log) + '[ "$1" = show ] && echo node1\nexit 0\n')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "VENV": str(venv), "SLURM_SUBMIT_DIR": str(tmp_path / "out"),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "4"}
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:  # a file, not a pipe: the stand-in srun would hold a pipe open
        job = subprocess.Popen(["bash", str(tmp_path / "out" / "launch" / "job.sbatch")], env=env,
                               stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        for _ in range(600):  # the stand-in srun starts once the script has set its trap
            if started.exists() or job.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists(), stderr.read_text()
        job.send_signal(signal.SIGUSR1)  # what SLURM sends 300 s before the time limit
        job.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the stand-in srun's sleep, if still there
            os.killpg(job.pid, signal.SIGKILL)
    assert log.read_text().splitlines()[-1] == "requeue 77"
    assert "job 77 is requeued and resumes from" in stderr.read_text()


def test_dockerfile_runs_as_a_non_root_user_who_owns_the_output_folder(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    lines = [line for line in (tmp_path / "launch" / "Dockerfile").read_text().splitlines()
             if line and not line.startswith("#")]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] == "10001:10001"  # numeric: the kubelet can check runAsNonRoot against it
    created = next(line for line in lines if "useradd" in line)
    assert "--uid 10001" in created and "--gid 10001" in created and "groupadd --gid 10001" in created
    assert f"COPY --chown=10001:10001 . {WORKDIR}" in lines
    trainjob, job = manifests(tmp_path)
    for pod in pod_security.job_pods(trainjob) + pod_security.job_pods(job):
        context = pod["securityContext"]
        assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == 10001


@pytest.mark.parametrize("gpus_per_node", [8, 2])
def test_manifests_pass_the_restricted_pod_security_standard(tmp_path, gpus_per_node):
    write_program(make_plan(gpus_per_node=gpus_per_node), tmp_path, MLP)
    for manifest in manifests(tmp_path):
        pods = pod_security.job_pods(manifest)
        assert len(pods) == (1 if manifest["kind"] == "TrainJob" else 1 + (gpus_per_node < 4))
        pod_security.check_job(manifest)
        for pod in pods:  # and what training needs still there: /dev/shm in memory, the checkpoint volume, GPUs
            volumes = {volume["name"]: volume for volume in pod["volumes"]}
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            assert "persistentVolumeClaim" in volumes["checkpoints"]
            mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
            assert mounts == {"/dev/shm", "/checkpoints"}
            assert pod["securityContext"]["fsGroup"] == 10001  # the volume is writable for the user
    container = manifests(tmp_path)[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(min(gpus_per_node, 4))


@pytest.mark.parametrize("path, value, problem", [
    (("securityContext", "runAsNonRoot"), None, "runAsNonRoot is not true"),
    (("securityContext", "runAsUser"), 0, "runAsUser 0"),
    (("securityContext", "seccompProfile"), {"type": "Unconfined"}, "seccompProfile Unconfined"),
    (("securityContext", "seccompProfile"), None, "no seccompProfile"),
    (("containers", 0, "securityContext", "allowPrivilegeEscalation"), None, "allowPrivilegeEscalation is not false"),
    (("containers", 0, "securityContext", "capabilities"), {"add": ["SYS_ADMIN"]}, "do not drop ALL"),
    (("containers", 0, "securityContext", "capabilities"), {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "adds capab"),
    (("containers", 0, "securityContext", "privileged"), True, "privileged"),
    (("hostIPC",), True, "hostIPC is true"),
    (("volumes", 1), {"name": "checkpoints", "hostPath": {"path": "/ckpt"}}, "type ['hostPath'] not allowed"),
    (("initContainers",), [{"name": "setup", "image": "x"}], "initContainers[setup]: allowPrivilegeEscalation"),
])
def test_the_pod_security_check_finds_each_restricted_violation(tmp_path, path, value, problem):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    for manifest in manifests(tmp_path):
        pod_security.check_job(manifest)
        pod = pod_security.job_pods(manifest)[0]
        node = pod
        for step in path[:-1]:
            node = node[step]
        if value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
        with pytest.raises(AssertionError, match=re.escape(problem)):
            pod_security.check_job(manifest)
