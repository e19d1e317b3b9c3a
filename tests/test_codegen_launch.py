"""The launchers in launch/: torchrun.sh and job.sbatch name the plan's node and process counts and pass
shellcheck; trainjob.yaml and pytorchjob.yaml load into the Kubeflow SDKs' own models with no unknown
key; the Dockerfile builds the image the manifests expect; a 2-node plan's files give no one-node
instruction; train.py imports the shipped copy of the model unless asked for the planned file.
test_cluster_launch.py runs the scripts."""

import importlib
import os
import re
import shutil
import subprocess

import pytest
import yaml

from autoplan.codegen import write_program
from autoplan.codegen.kubernetes import check_manifest, pytorchjob_yaml, trainjob_yaml
from autoplan.codegen.launch import BASE_IMAGE, WORKDIR, Launch, checkpoint_interval
from autoplan.errors import UserError
from autoplan.plan import ModelRef
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
    plan = make_plan(data_parallel_replicate_degree=1, pipeline_parallel_degree=1, stages=[["inp", "out"]],
                     pipeline_parallel_num_microbatches=2, pipeline_parallel_microbatch_size=8,
                     model=ModelRef(path=str(planned)))
    write_program(plan, tmp_path / "out", planned)
    planned.write_text(MLP.read_text() + "\n\ndef build_model():\n    raise RuntimeError('edited after planning')\n")
    program = load_module(tmp_path / "out" / "train.py", "generated_train_model_file")
    assert program.parse_args([]).model_file == "copy"
    assert len(program.main(["--reference", "--steps", "1", "--device", "cpu"])) == 1
    with pytest.raises(RuntimeError, match="edited after planning"):
        program.main(["--reference", "--steps", "1", "--device", "cpu", "--model-file", "planned"])


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
