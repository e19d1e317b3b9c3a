"""The launchers in launch/: torchrun.sh and job.sbatch are valid bash naming the plan's node and
process counts; trainjob.yaml and pytorchjob.yaml parse back into manifests with the fields the
Kubeflow controllers require and the same counts."""

import re
import subprocess

import pytest
import yaml

from autoplan.codegen import write_program
from autoplan.codegen.launch import Launch, check_manifest, pytorchjob_manifest, trainjob_manifest
from autoplan.errors import UserError
from test_codegen import MLP, make_plan


def sbatch_options(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", text, flags=re.M))


@pytest.mark.parametrize("gpus_per_node, nodes, per_node", [(8, 1, 4), (2, 2, 2), (1, 4, 1)])
def test_launchers_name_the_node_and_process_counts(tmp_path, gpus_per_node, nodes, per_node):
    write_program(make_plan(gpus_per_node=gpus_per_node), tmp_path, MLP)  # 4 processes
    launch = tmp_path / "launch"
    for script in ("torchrun.sh", "job.sbatch"):
        subprocess.run(["bash", "-n", str(launch / script)], check=True)
    torchrun = (launch / "torchrun.sh").read_text()
    assert f'NNODES="${{NNODES:-{nodes}}}"' in torchrun and f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{per_node}}}"' in torchrun
    sbatch = (launch / "job.sbatch").read_text()
    options = sbatch_options(sbatch)
    assert options["nodes"] == str(nodes) and options["gpus-per-node"] == str(per_node)
    assert options["ntasks-per-node"] == "1"  # one torchrun per node
    assert f"--nproc-per-node {per_node}" in sbatch and '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in sbatch

    trainjob = yaml.safe_load((launch / "trainjob.yaml").read_text())
    assert trainjob["kind"] == "TrainJob" and trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = trainjob["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, per_node)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == per_node

    job = yaml.safe_load((launch / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == str(per_node)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas.get("Worker", {}).get("replicas", 0) == nodes - 1
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"] == ["torchrun", "train.py"]


def test_multi_node_torchrun_needs_the_rendezvous_host(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    script = (tmp_path / "launch" / "torchrun.sh").read_text()
    assert "--rdzv-backend c10d" in script and '--rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"' in script
    run = subprocess.run(["bash", str(tmp_path / "launch" / "torchrun.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "set MASTER_ADDR" in run.stderr


def test_uneven_nodes_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"4 processes do not fill whole nodes of 3 GPUs \(4 / 3 = 1.33 nodes\)"):
        write_program(make_plan(gpus_per_node=3), tmp_path, MLP)


@pytest.mark.parametrize("build, path, value", [
    (trainjob_manifest, ("spec", "trainer", "numNodes"), 3),
    (trainjob_manifest, ("spec", "runtimeRef", "name"), ""),
    (pytorchjob_manifest, ("spec", "nprocPerNode"), "8"),
    (pytorchjob_manifest, ("spec", "pytorchReplicaSpecs", "Master", "replicas"), 2),
])
def test_manifest_check_catches_wrong_counts_and_missing_fields(build, path, value):
    launch = Launch(nnodes=2, nproc_per_node=4)
    manifest = build(launch)
    check_manifest(manifest, launch)
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(AssertionError, match="generated manifest"):
        check_manifest(manifest, launch)
