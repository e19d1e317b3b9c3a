"""autoplan.codegen: the files write_program writes, that no plan string can change the program,
the launchers, and the layouts it refuses (with the numbers that conflict)."""

import ast
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.errors import UserError
from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training

MLP = Path(__file__).resolve().parents[1] / "examples" / "mlp.py"


def make_plan(stages=(("inp", "layers.0"), ("layers.1", "out")), gpus_per_node=8, global_batch=16,
              model=ModelRef(path=str(MLP)), **parallelism) -> Plan:
    defaults = dict(data_parallel_replicate_degree=2, pipeline_parallel_degree=2, pipeline_parallel_schedule="1f1b",
                    pipeline_parallel_num_microbatches=4, pipeline_parallel_microbatch_size=2)
    par = Parallelism(**{**defaults, **parallelism})
    return Plan(
        model=model,
        cluster=ClusterRef(gpu="h100-sxm5-80gb", num_gpus=par.world_size, gpus_per_node=gpus_per_node,
                           memory_per_gpu_bytes=80 * 2**30),
        training=Training(global_batch_size=global_batch),
        parallelism=par,
        stages=tuple(Stage(index=i, modules=tuple(m), predicted_time_s=0.01, predicted_memory_bytes=1e9)
                     for i, m in enumerate(stages)),
        predicted=Prediction(step_time_s=0.1, samples_per_s=160.0, tokens_per_s=None, model_flops_per_step=1e12,
                             mfu=0.4, peak_memory_bytes=1e9),
        solver=SolverInfo(name="highs", status="optimal", time_s=0.1, candidates_evaluated=10),
    )


def config_values(train_py: str) -> dict:
    """The literal assignments at the top level of train.py."""
    values = {}
    for node in ast.parse(train_py).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def test_writes_train_py_model_copy_and_launcher(tmp_path):
    write_program(make_plan(), tmp_path, MLP)
    train_py = (tmp_path / "train.py").read_text()
    compile(train_py, "train.py", "exec")
    assert (tmp_path / "model.py").read_bytes() == MLP.read_bytes()
    assert "    torchrun --standalone --nproc-per-node 4 train.py\n" in train_py
    assert "python train.py --reference" in train_py
    config = config_values(train_py)
    assert config["STAGES"] == [["inp", "layers.0"], ["layers.1", "out"]]
    assert (config["DP_REPLICATE"], config["PP"], config["SCHEDULE"], config["NUM_MICROBATCHES"]) == (2, 2, "1f1b", 4)
    assert config["GLOBAL_BATCH"] == 16 and config["LEARNING_RATE"] == 1e-3 and config["SEED"] == 0
    script = tmp_path / "launch" / "torchrun.sh"
    assert os.access(script, os.X_OK)
    assert 'NPROC_PER_NODE="${NPROC_PER_NODE:-4}"' in script.read_text()
    assert 'NNODES="${NNODES:-1}"' in script.read_text()


def test_strange_module_and_file_names_cannot_change_the_program(tmp_path):
    evil = ['x"""\nimport os; os.system("echo pwned")\n"""', "a'b\\", "layers.0\n# comment", "  ", "{}%s"]
    model_dir = tmp_path / 'dir "with" quotes\nand newline'
    model_dir.mkdir()
    model_file = model_dir / "my model's file.py"
    shutil.copyfile(MLP, model_file)
    plan = make_plan(stages=(evil[:2], evil[2:]), model=ModelRef(path=str(model_file), factory='build"\nmodel'))
    out = tmp_path / "out"
    write_program(plan, out, model_file)
    train_py = (out / "train.py").read_text()
    compile(train_py, "train.py", "exec")
    config = config_values(train_py)
    assert config["STAGES"] == [evil[:2], evil[2:]]
    assert config["FACTORY"] == 'build"\nmodel' and config["MODEL_SOURCE"] == str(model_file)
    assert "pwned" not in ast.get_docstring(ast.parse(train_py))
    assert (out / "model.py").read_bytes() == MLP.read_bytes()


def test_multi_node_launcher(tmp_path):
    write_program(make_plan(gpus_per_node=2), tmp_path, MLP)
    script = (tmp_path / "launch" / "torchrun.sh").read_text()
    assert 'NNODES="${NNODES:-2}"' in script and 'NPROC_PER_NODE="${NPROC_PER_NODE:-2}"' in script
    assert "--rdzv-backend c10d" in script and '--rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"' in script
    subprocess.run(["bash", "-n", str(tmp_path / "launch" / "torchrun.sh")], check=True)
    docstring = ast.get_docstring(ast.parse((tmp_path / "train.py").read_text()))
    assert "NNODES=2 MASTER_ADDR=<node 0 host> bash launch/torchrun.sh" in docstring
    with pytest.raises(UserError, match=r"4 processes do not fill whole nodes of 3 GPUs"):
        write_program(make_plan(gpus_per_node=3), tmp_path / "other", MLP)


@pytest.mark.parametrize("change, message", [
    (dict(tensor_parallel_degree=2), r"tensor parallelism \(tp=2\) is not generated yet"),
    (dict(pipeline_parallel_schedule="interleaved"), r"schedule 'interleaved' is not generated yet"),
    (dict(activation_checkpoint="selective"), r"activation_checkpoint 'selective'"),
    (dict(pipeline_parallel_num_microbatches=3), r"global batch 16 != dp 2 x micro-batches 3 x micro-batch size 2 = 12"),
    (dict(pipeline_parallel_num_microbatches=1, pipeline_parallel_microbatch_size=8),
     r"1f1b needs at least as many micro-batches as stages: 1 < 2"),
    (dict(data_parallel_replicate_degree=1, data_parallel_shard_degree=2), r"zero_stage 0 \(DDP\) replicates"),
    (dict(pipeline_parallel_degree=4, data_parallel_replicate_degree=1, pipeline_parallel_num_microbatches=8),
     r"pipeline_parallel_degree is 4 but the plan lists 2 stages"),
])
def test_layouts_the_program_cannot_run_are_refused(tmp_path, change, message):
    plan = make_plan()
    plan = replace(plan, parallelism=replace(plan.parallelism, **change))
    with pytest.raises(UserError, match=message):
        write_program(plan, tmp_path, MLP)
    assert not (tmp_path / "train.py").exists()


def test_missing_model_file(tmp_path):
    with pytest.raises(UserError, match="model file not found"):
        write_program(make_plan(), tmp_path / "out", tmp_path / "nope.py")
