"""autoplan.codegen: the files write_program writes, that no plan string can change the program,
that train.py's main is importable, and the plans it refuses (with the numbers that conflict).
The launchers are tested in test_codegen_launch.py."""

import ast
import importlib.util
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.errors import UserError
from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training

MLP = Path(__file__).resolve().parents[1] / "examples" / "mlp.py"


def make_plan(stages=(("inp", "layers.0"), ("layers.1", "out")), gpus_per_node=8, global_batch=16,
              model=ModelRef(path=str(MLP)), tensor_parallel_plan=None, recompute=(), **parallelism) -> Plan:
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
        tensor_parallel_plan=dict(tensor_parallel_plan or {}),
        activation_checkpoint_modules=tuple(recompute),
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
    assert (config["DP_REPLICATE"], config["PP"], config["SCHEDULE"], config["MICROBATCHES"]) == (2, 2, "1f1b", 4)
    assert config["GLOBAL_BATCH"] == 16 and config["LEARNING_RATE"] == 1e-3 and config["SEED"] == 0
    assert (config["TP"], config["VIRTUAL_STAGES"], config["DP_SHARD"], config["RESHARD"], config["DTYPE"]) == (
        1, 1, 1, "never", "fp32")
    assert config["TENSOR_PARALLEL_PLAN"] == {} and config["RECOMPUTE_MODULES"] == []
    assert config["MODEL_FLOPS_PER_STEP"] == 1e12
    assert config["PEAK_FLOPS_PER_GPU"] == 67e12  # the H100 SXM profile's dense fp32 peak
    assert sorted(p.name for p in (tmp_path / "launch").iterdir()) == [
        "job.sbatch", "pytorchjob.yaml", "torchrun.sh", "trainjob.yaml"]


def test_layout_numbers_reach_the_program(tmp_path):
    tp_plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    plan = make_plan(stages=(("inp",), ("layers.0",), ("layers.1",), ("out",)), tensor_parallel_plan=tp_plan,
                     recompute=("layers.1",), data_parallel_replicate_degree=1, data_parallel_shard_degree=2,
                     fsdp_reshard_after_forward="always", tensor_parallel_degree=2, pipeline_parallel_virtual_stages=2,
                     pipeline_parallel_schedule="interleaved", activation_checkpoint="selective", global_batch=16)
    plan = replace(plan, training=replace(plan.training, dtype="bf16"))
    write_program(plan, tmp_path, MLP)
    train_py = (tmp_path / "train.py").read_text()
    config = config_values(train_py)
    assert (config["DP_SHARD"], config["TP"], config["PP"], config["VIRTUAL_STAGES"]) == (2, 2, 2, 2)
    assert config["DTYPE"] == "bf16" and config["PEAK_FLOPS_PER_GPU"] == 989e12  # H100 SXM dense bf16
    assert config["TENSOR_PARALLEL_PLAN"] == tp_plan and config["RECOMPUTE_MODULES"] == ["layers.1"]
    assert config["RECOMPUTE"] == "selective" and config["SCHEDULE"] == "interleaved" and config["RESHARD"] == "always"
    docstring = ast.get_docstring(ast.parse(train_py))
    assert "torchrun --standalone --nproc-per-node 8 train.py" in docstring
    assert "2-way tensor parallel (2 Linears)" in docstring and "2 stages per rank" in docstring
    assert "FSDP2: dp_replicate 1 x dp_shard 2, reshard always" in docstring and "selective activation checkpointing" in docstring
    assert "bf16 mixed precision on GPUs" in docstring and "On CPU it trains in fp32" in docstring


def test_train_py_main_is_importable_and_takes_argv(tmp_path):
    write_program(make_plan(data_parallel_replicate_degree=1, pipeline_parallel_degree=1, stages=[["inp", "out"]],
                            pipeline_parallel_num_microbatches=2, pipeline_parallel_microbatch_size=8), tmp_path, MLP)
    spec = importlib.util.spec_from_file_location("generated_train", tmp_path / "train.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)  # importing runs nothing
    args = program.parse_args(["--steps", "2", "--device", "cpu", "--checkpoint-dir", "ck", "--resume"])
    assert (args.steps, args.resume, args.checkpoint_dir) == (2, True, Path("ck"))
    losses = program.main(["--reference", "--steps", "2", "--device", "cpu"])
    assert len(losses) == 2 and losses[0] != losses[1]


def test_strange_module_and_file_names_cannot_change_the_program(tmp_path):
    evil = ['x"""\nimport os; os.system("echo pwned")\n"""', "a'b\\", "layers.0\n# comment", "  ", "{}%s"]
    model_dir = tmp_path / 'dir "with" quotes\nand newline'
    model_dir.mkdir()
    model_file = model_dir / "my model's file.py"
    shutil.copyfile(MLP, model_file)
    plan = make_plan(stages=(evil[:2], evil[2:]), model=ModelRef(path=str(model_file), factory='build"\nmodel'),
                     tensor_parallel_plan={evil[0]: "colwise", evil[4]: "rowwise"}, recompute=evil,
                     activation_checkpoint="full")
    out = tmp_path / "out"
    write_program(plan, out, model_file)
    train_py = (out / "train.py").read_text()
    compile(train_py, "train.py", "exec")
    config = config_values(train_py)
    assert config["STAGES"] == [evil[:2], evil[2:]] and config["RECOMPUTE_MODULES"] == evil
    assert config["TENSOR_PARALLEL_PLAN"] == {evil[0]: "colwise", evil[4]: "rowwise"}
    assert config["FACTORY"] == 'build"\nmodel' and config["MODEL_SOURCE"] == str(model_file)
    assert "pwned" not in ast.get_docstring(ast.parse(train_py))
    assert (out / "model.py").read_bytes() == MLP.read_bytes()


@pytest.mark.parametrize("change, message", [
    (dict(tensor_parallel_degree=2), r"tp=2, but the plan's tensor_parallel_plan names no module to shard"),
    (dict(pipeline_parallel_virtual_stages=2),
     r"virtual_stages=2 needs schedule=interleaved and pp > 1 \(schedule=1f1b, pp=2\)"),
    (dict(pipeline_parallel_schedule="interleaved", pipeline_parallel_num_microbatches=3, global_batch=12),
     r"schedule=interleaved needs a multiple of pp=2 micro-batches, but microbatches = 3"),
    (dict(pipeline_parallel_virtual_stages=2, pipeline_parallel_schedule="interleaved"),
     r"pp=2 x virtual_stages=2 = 4 stages, but the plan lists 2"),
    (dict(activation_checkpoint="most"), r"recompute=most is not one of none, selective, full"),
    (dict(pipeline_parallel_num_microbatches=3), r"microbatches=3, but global batch 16 / dp=2 / microbatch=2 = 4"),
    (dict(pipeline_parallel_num_microbatches=1, pipeline_parallel_microbatch_size=8),
     r"schedule=1f1b needs at least pp=2 micro-batches, but microbatches = 1"),
    (dict(fsdp_reshard_after_forward="always"), r"reshard=always needs dp_shard > 1"),
    (dict(fsdp_reshard_after_forward="sometimes"), r"reshard=sometimes is not one of always, never"),
    (dict(pipeline_parallel_degree=4, data_parallel_replicate_degree=1, pipeline_parallel_num_microbatches=8),
     r"pp=4 x virtual_stages=1 = 4 stages, but the plan lists 2"),
])
def test_plans_the_program_cannot_run_are_refused(tmp_path, change, message):
    plan = make_plan()
    global_batch = change.pop("global_batch", None)
    plan = replace(plan, parallelism=replace(plan.parallelism, **change))
    if global_batch:
        plan = replace(plan, training=replace(plan.training, global_batch_size=global_batch))
    with pytest.raises(UserError, match=message):
        write_program(plan, tmp_path, MLP)
    assert not (tmp_path / "train.py").exists()


def test_missing_model_file(tmp_path):
    with pytest.raises(UserError, match="model file not found"):
        write_program(make_plan(), tmp_path / "out", tmp_path / "nope.py")
