"""autoplan.codegen: the files write_program writes, that no plan string can change the program,
that train.py's main is importable, and the plans it refuses (with the numbers that conflict); the
template train.py is made from (it lints, it imports, it renders to tests/golden/train.py) and the
runtime API version a generated program checks first. The launchers are tested in test_codegen_launch.py.

When a change to the template or to the plan's fields changes train.py on purpose, regenerate the golden
file and review its diff:

    AUTOPLAN_UPDATE_GOLDEN=1 pytest tests/test_codegen.py -k golden && git diff tests/golden/
"""

import ast
import difflib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from pyflakes.api import check as pyflakes_check
from pyflakes.reporter import Reporter

from autoplan import runtime
from autoplan.codegen import check_supported, render_train_py, write_program
from autoplan.codegen.launch import launch_layout
from autoplan.codegen.template import placeholder_config, template_text
from autoplan.errors import UserError
from autoplan.layout import VOCABULARY
from autoplan.runtime.distributed.config import ParallelConfig
from autoplan.runtime.harness.reference import run_reference
from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mlp.py"
TEMPLATE = ROOT / "autoplan" / "codegen" / "templates" / "train.py"
GOLDEN = Path(__file__).resolve().parent / "golden" / "train.py"
UPDATE_GOLDEN = "AUTOPLAN_UPDATE_GOLDEN"
"""Set it to 1 to rewrite the golden files from the current code instead of comparing with them."""


def make_plan(stages=(("inp", "layers.0"), ("layers.1", "out")), gpus_per_node=8, global_batch=16,
              model=ModelRef(path=str(MLP)), tensor_parallel_plan=None, recompute_modules=(), **parallelism) -> Plan:
    defaults = dict(dp_replicate=2, pp=2, schedule="1f1b",
                    microbatches=4, microbatch=2)
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
        activation_checkpoint_modules=tuple(recompute_modules),
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
    assert (tmp_path / "model_code" / "mlp.py").read_bytes() == MLP.read_bytes()
    assert sorted(p.name for p in (tmp_path / "model_code").iterdir()) == ["mlp.py"]  # it imports no neighbour
    assert config_values(train_py)["MODEL_SOURCE"] == str(MLP)
    assert "    torchrun --standalone --nproc-per-node 4 train.py\n" in train_py
    assert "    autoplan verify .\n" in train_py
    config = config_values(train_py)
    assert config["STAGES"] == [["inp", "layers.0"], ["layers.1", "out"]]
    assert (config["DP_REPLICATE"], config["PP"], config["SCHEDULE"], config["MICROBATCHES"]) == (2, 2, "1f1b", 4)
    assert config["GLOBAL_BATCH"] == 16 and config["LEARNING_RATE"] == 1e-3 and config["SEED"] == 0
    assert (config["TP"], config["VIRTUAL_STAGES"], config["DP_SHARD"], config["RESHARD"], config["DTYPE"]) == (
        1, 1, 1, False, "fp32")
    assert config["TENSOR_PARALLEL_PLAN"] == {} and config["RECOMPUTE_MODULES"] == []
    assert config["MODEL_FLOPS_PER_STEP"] == 1e12
    assert config["PEAK_FLOPS_PER_GPU"] == 67e12  # the H100 SXM profile's dense fp32 peak
    assert sorted(p.name for p in (tmp_path / "launch").iterdir()) == [
        "Dockerfile", "job.sbatch", "pytorchjob.yaml", "torchrun.sh", "trainjob.yaml"]


def test_layout_numbers_reach_the_program(tmp_path):
    tp_plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    plan = make_plan(stages=(("inp",), ("layers.0",), ("layers.1",), ("out",)), tensor_parallel_plan=tp_plan,
                     recompute_modules=("layers.1",), dp_replicate=1, dp_shard=2,
                     reshard=True, tp=2, sp=True,
                     virtual_stages=2,
                     schedule="interleaved", recompute="selective", global_batch=16)
    plan = replace(plan, training=replace(plan.training, dtype="bf16"))
    write_program(plan, tmp_path, MLP)
    train_py = (tmp_path / "train.py").read_text()
    config = config_values(train_py)
    assert (config["DP_SHARD"], config["TP"], config["PP"], config["VIRTUAL_STAGES"]) == (2, 2, 2, 2)
    assert config["DTYPE"] == "bf16" and config["PEAK_FLOPS_PER_GPU"] == 989e12  # H100 SXM dense bf16
    assert config["TENSOR_PARALLEL_PLAN"] == tp_plan and config["RECOMPUTE_MODULES"] == ["layers.1"]
    assert config["RECOMPUTE"] == "selective" and config["SCHEDULE"] == "interleaved" and config["RESHARD"] is True
    docstring = ast.get_docstring(ast.parse(train_py))
    assert "torchrun --standalone --nproc-per-node 8 train.py" in docstring
    assert "2-way tensor parallel (2 Linears, sequence parallel)" in docstring and "2 stages per rank" in docstring
    assert config["SP"] is True  # the default whenever TP > 1
    write_program(replace(plan, parallelism=replace(plan.parallelism, sp=False)), tmp_path, MLP)
    train_py = (tmp_path / "train.py").read_text()
    assert config_values(train_py)["SP"] is False and "2-way tensor parallel (2 Linears)" in train_py
    assert "FSDP2: dp_replicate 1 x dp_shard 2, reshard always" in docstring and "selective activation checkpointing" in docstring
    assert "bf16 mixed precision on GPUs" in docstring and "On CPU it trains in fp32" in docstring


OTHER_TEXT_VALUES = {"schedule": "interleaved", "recompute": "full"}
"""A value other than the default for each text field of Parallelism (a new text field: add one of its values)."""
MLP_CHAIN = ("inp", "layers.0", "layers.1", "out")


def _other_value(name: str, default: object) -> object:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    return OTHER_TEXT_VALUES[name]


def _train_py_of(plan: Plan, tmp_path: Path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(render_train_py(plan, launch_layout(plan)))
    return path.read_text(), load_module(path, f"autoplan_round_trip_{name}")


LAYOUT_TERMS = [term.short for term in VOCABULARY if term.short in {f.name for f in fields(Parallelism)}]


def test_every_parallelism_field_is_a_vocabulary_term():
    """The round trip below runs over VOCABULARY's terms: a field of Parallelism without a term would go untested."""
    assert set(LAYOUT_TERMS) == {f.name for f in fields(Parallelism)} and len(LAYOUT_TERMS) == len(fields(Parallelism))


@pytest.mark.parametrize("short", LAYOUT_TERMS)
def test_train_py_constants_round_trip_to_the_plans_parallelism(tmp_path, short):
    """For each term of the vocabulary that is a layout field: a plan with it off its default writes a train.py whose
    constant (the short name upper case, a real type: True/False for the booleans) holds the plan's value, and whose
    parallel_config() is the plan's own (ParallelConfig.of: the same Parallelism and module lists)."""
    default = getattr(Parallelism(), short)
    value = _other_value(short, default)
    base = Parallelism(**{short: value})
    stages = [MLP_CHAIN[:2], MLP_CHAIN[2:]] if base.pp * base.virtual_stages == 2 else [MLP_CHAIN]
    plan = make_plan(stages=stages, **{**dict(dp_replicate=1, pp=1, microbatches=1, microbatch=1), short: value})
    assert getattr(plan.parallelism, short) == value != default
    train_py, program = _train_py_of(plan, tmp_path, short)
    constant = config_values(train_py)[short.upper()]
    assert constant == value and type(constant) is type(value)
    assert program.parallel_config() == ParallelConfig.of(plan)
    assert program.parallel_config().parallelism == plan.parallelism


def test_train_py_compile_constant_round_trips(tmp_path):
    plan = make_plan(stages=[MLP_CHAIN], dp_replicate=1, pp=1, microbatches=1, microbatch=1)
    plan = replace(plan, compile=replace(plan.compile, enable=True))
    train_py, program = _train_py_of(plan, tmp_path, "compiled")
    assert config_values(train_py)["COMPILE"] is True
    assert program.parallel_config() == ParallelConfig.of(plan) and program.parallel_config().compile is True
    assert program.parallel_config(False).compile is False  # train.py --no-compile


def test_a_hand_edited_layout_constant_of_the_old_spelling_is_one_clear_error():
    """train.py's constants are Parallelism's fields in their types: RESHARD = "always" (runtime API 11's spelling)
    is refused, naming the field and the value."""
    with pytest.raises(UserError, match=r"parallel config: reshard must be True or False, got 'always'"):
        ParallelConfig(replace(Parallelism(), reshard="always"))
    with pytest.raises(UserError, match=r"tp must be a positive integer, got 0.*schedule must be one of"):
        ParallelConfig(replace(Parallelism(), tp=0, schedule="1F1B"))


def test_train_py_main_is_importable_and_takes_argv(tmp_path):
    write_program(make_plan(dp_replicate=1, pp=1, stages=[["inp", "out"]],
                            microbatches=2, microbatch=8), tmp_path, MLP)
    spec = importlib.util.spec_from_file_location("generated_train", tmp_path / "train.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)  # importing runs nothing
    args = program.parse_args(["--steps", "2", "--device", "cpu", "--checkpoint-dir", "ck", "--resume"])
    assert (args.steps, args.resume, args.checkpoint_dir) == (2, True, Path("ck"))
    losses = run_reference(tmp_path / "train.py", ["--steps", "2", "--device", "cpu"])  # autoplan verify's
    assert len(losses) == 2 and losses[0] != losses[1]


def test_strange_module_and_file_names_cannot_change_the_program(tmp_path):
    evil = ['x"""\nimport os; os.system("echo pwned")\n"""', "a'b\\", "layers.0\n# comment", "  ", "{}%s"]
    model_dir = tmp_path / 'dir "with" quotes\nand newline'
    model_dir.mkdir()
    model_file = model_dir / "my model's file.py"
    shutil.copyfile(MLP, model_file)
    plan = make_plan(stages=(evil[:2], evil[2:]), model=ModelRef(path=str(model_file), factory='build"\nmodel'),
                     tensor_parallel_plan={evil[0]: "colwise", evil[4]: "rowwise"}, recompute_modules=evil,
                     recompute="full")
    out = tmp_path / "out"
    write_program(plan, out, model_file)
    train_py = (out / "train.py").read_text()
    compile(train_py, "train.py", "exec")
    config = config_values(train_py)
    assert config["STAGES"] == [evil[:2], evil[2:]] and config["RECOMPUTE_MODULES"] == evil
    assert config["TENSOR_PARALLEL_PLAN"] == {evil[0]: "colwise", evil[4]: "rowwise"}
    assert config["FACTORY"] == 'build"\nmodel' and config["MODEL_SOURCE"] == str(model_file)
    assert "pwned" not in ast.get_docstring(ast.parse(train_py))
    assert (out / "model_code" / "my model's file.py").read_bytes() == MLP.read_bytes()


@pytest.mark.parametrize("change, message", [
    (dict(tp=2), r"tp=2, but the plan's tensor_parallel_plan names no module to shard"),
    (dict(virtual_stages=2),
     r"schedule=1f1b runs 1 stage per pipeline rank, but virtual_stages=2 \(virtual stages need "
     r"schedule=interleaved"),
    (dict(schedule="interleaved", microbatches=3, global_batch=12),
     r"schedule=interleaved needs a multiple of pp=2 micro-batches, but microbatches = 3"),
    (dict(virtual_stages=2, schedule="interleaved"),
     r"pp=2 x virtual_stages=2 = 4 stages, but the plan lists 2"),
    (dict(recompute="most"), r"recompute=most is not one of none, selective, full"),
    (dict(microbatches=3), r"microbatches=3, but global batch 16 / dp=2 / microbatch=2 = 4"),
    (dict(microbatches=1, microbatch=8),
     r"schedule=1f1b needs at least pp=2 micro-batches, but microbatches = 1"),
    (dict(reshard=True), r"reshard=always needs dp_shard > 1"),
    (dict(pp=4, dp_replicate=1, microbatches=8),
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


def lint(source: str, filename: str) -> list[str]:
    """pyflakes' findings on `source` (undefined names, unused imports, syntax errors), one per line."""
    out, err = io.StringIO(), io.StringIO()
    pyflakes_check(source, filename, Reporter(out, err))
    return (out.getvalue() + err.getvalue()).splitlines()


def top_level_names(source: str) -> set[str]:
    """The names a module assigns at its top level (its config constants)."""
    return {target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def load_module(path: Path, name: str):
    """Import the file `path` as module `name` (not registered in sys.modules); importing runs no main."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def golden_plan() -> Plan:
    """A fixed plan that reaches every branch of the rendering: two nodes, HSDP with resharding, tensor
    parallel, an interleaved pipeline, selective recompute, bf16. Built by hand (no capture), with a
    relative model path, so its train.py is the same on every machine."""
    parallelism = Parallelism(
        dp_replicate=2, dp_shard=2, reshard=True,
        tp=2, pp=2, virtual_stages=2,
        schedule="interleaved", microbatch=2,
        microbatches=4, recompute="selective", sp=True)
    stages = (("inp", "layers.0"), ("layers.1", "layers.2"), ("layers.3", "layers.4"), ("layers.5", "out"))
    return Plan(
        model=ModelRef(path="examples/mlp.py", factory="build_model"),
        cluster=ClusterRef(gpu="h100-sxm5-80gb", num_gpus=16, gpus_per_node=8, memory_per_gpu_bytes=80 * 2**30),
        training=Training(global_batch_size=32, dtype="bf16", learning_rate=3e-4, seed=7),
        parallelism=parallelism,
        stages=tuple(Stage(index=i, modules=m, predicted_time_s=0.01, predicted_memory_bytes=2**30)
                     for i, m in enumerate(stages)),
        predicted=Prediction(step_time_s=0.2, samples_per_s=160.0, tokens_per_s=None, model_flops_per_step=4e12,
                             mfu=0.3, peak_memory_bytes=2**30),
        solver=SolverInfo(name="highs", status="optimal", time_s=0.1, candidates_evaluated=12),
        tensor_parallel_plan={"layers.0.0": "colwise", "layers.1.0": "rowwise"},
        activation_checkpoint_modules=("layers.1", "layers.3"),
    )


def render_golden_plan() -> str:
    plan = golden_plan()
    check_supported(plan)  # the golden program is one autoplan would write
    return render_train_py(plan, launch_layout(plan))


def test_lint_finds_undefined_names_and_unused_imports():
    """The check below can fail: pyflakes reports what it is there to find."""
    findings = lint("import os\nprint(UNDEFINED)\n", "bad.py")
    assert len(findings) == 2
    assert "'os' imported but unused" in findings[0] and "undefined name 'UNDEFINED'" in findings[1]


def test_template_lints_clean():
    assert lint(TEMPLATE.read_text(), str(TEMPLATE)) == []


def test_golden_train_py_lints_clean():
    """The rendered program defines every name the template uses (config block and placeholders agree)."""
    assert lint(render_golden_plan(), "train.py") == []


def test_template_imports_with_its_placeholder_config_without_running_main(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "not-a-number"])  # main would exit on these
    program = load_module(TEMPLATE, "autoplan_train_template")
    assert program.RUNTIME_API == runtime.RUNTIME_API, "bump RUNTIME_API in the template with autoplan.runtime's"
    assert (program.DP_SHARD, program.PP, program.TP, program.FACTORY) == (1, 1, 1, "build_model")
    assert program.parallel_config().parallelism == Parallelism()  # the placeholders: the layout's defaults
    assert program.parse_args(["--steps", "3"]).steps == 3 and callable(program.main)
    assert "autoplan.codegen.templates.train" not in sys.modules  # nothing imports it as autoplan code


def test_rendering_sets_exactly_the_template_placeholders():
    """render_train_py's config block assigns the names the template's placeholder block does: a name
    renamed in one and not the other fails here (and in the lint of the golden program)."""
    placeholders = top_level_names(placeholder_config())
    rendered = top_level_names(render_golden_plan()) - (top_level_names(template_text()) - placeholders)
    assert rendered == placeholders, (f"only in the rendered config: {sorted(rendered - placeholders)}; "
                                      f"only in the template's placeholders: {sorted(placeholders - rendered)}")
    assert {"STAGES", "DP_SHARD", "TENSOR_PARALLEL_PLAN"} <= placeholders


def test_rendering_replaces_the_template_docstring_and_markers_and_keeps_the_rest():
    train_py = render_golden_plan()
    assert train_py.startswith('"""Distributed training program generated by autoplan.\n')
    assert "# --- plan config" not in train_py and "Template of the train.py" not in train_py
    template_body = template_text().split("# --- plan config end ---\n")[1]
    assert train_py.endswith(template_body)
    assert "\nDP_SHARD = 2 " in train_py and "\nSTAGES = [  #" in train_py


def test_golden_train_py():
    """train.py for a fixed plan, byte for byte (regenerate: see this module's docstring)."""
    rendered = render_golden_plan()
    if os.environ.get(UPDATE_GOLDEN) == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(rendered)
        pytest.skip(f"rewrote {GOLDEN.relative_to(ROOT)}: review it with git diff")
    golden = GOLDEN.read_text() if GOLDEN.exists() else ""
    if rendered != golden:
        diff = "".join(difflib.unified_diff(golden.splitlines(keepends=True), rendered.splitlines(keepends=True),
                                            "tests/golden/train.py", "rendered now", n=1))
        pytest.fail(f"the rendered train.py differs from {GOLDEN.relative_to(ROOT)} ({len(diff.splitlines())} "
                    f"diff lines below). If the change is intended, regenerate and review it:\n"
                    f"    {UPDATE_GOLDEN}=1 pytest tests/test_codegen.py -k golden && git diff tests/golden/\n"
                    f"{diff[:6000]}", pytrace=False)


def test_runtime_api_match_passes(capsys):
    assert runtime.runtime_api_mismatch(runtime.RUNTIME_API) is None
    assert runtime.check_runtime_api(runtime.RUNTIME_API) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("offset", [-1, 1], ids=["older program", "newer program"])
def test_runtime_api_mismatch_exits_with_one_line(capsys, monkeypatch, offset):
    program_api = runtime.RUNTIME_API + offset
    monkeypatch.setattr(sys, "argv", ["/some/dir/train.py"])
    with pytest.raises(SystemExit) as exited:
        runtime.check_runtime_api(program_api)
    assert exited.value.code == runtime.MISMATCH_EXIT_CODE == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: ")
    assert f"generated for autoplan runtime API {program_api}," in err
    assert f"provides runtime API {runtime.RUNTIME_API}:" in err
    assert "re-run autoplan on the model" in err and "to regenerate train.py" in err
    assert f"or install the autoplan that generated it (runtime API {program_api})" in err


def test_the_runtime_api_check_comes_before_any_other_autoplan_name():
    """Issue 26: the template imported autoplan.procs (added without a RUNTIME_API bump) above its check, so a new
    train.py on an older autoplan died of an ImportError instead of the one line. The program binds the package
    and its runtime, checks, and only then reads any other autoplan name (all through those two)."""
    tree = ast.parse(TEMPLATE.read_text())
    check = next(i for i, node in enumerate(tree.body) if ast.unparse(node) == "runtime.check_runtime_api(RUNTIME_API)")
    imports = [(i, ast.unparse(node)) for i, node in enumerate(tree.body) if isinstance(node, (ast.Import, ast.ImportFrom))
               and "autoplan" in ast.unparse(node)]
    assert [text for _, text in imports] == ["import autoplan", "from autoplan import runtime"]
    assert all(i < check for i, _ in imports)
    nested = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
              and node not in tree.body]
    assert not [text for text in nested if "autoplan" in text], "every autoplan name goes through the check"
    used_before = {node.id for statement in tree.body[:check] if not isinstance(statement, (ast.Import, ast.ImportFrom))
                   for node in ast.walk(statement) if isinstance(node, ast.Name)}
    assert not used_before & {"autoplan", "runtime"}


@pytest.mark.parametrize("program", ["template", "golden"])
def test_a_program_on_an_older_autoplan_stops_with_the_one_line(tmp_path, monkeypatch, capsys, program):
    """An autoplan from before the interface grew: it provides the previous RUNTIME_API and lacks what was added
    (autoplan.procs, importing it fails; runtime.exit_skipping_teardown and runtime.load_source). Importing the
    program stops at once with the mismatch line and exit code 2, nothing imported that could fail first."""
    from autoplan.runtime import interface

    new = runtime.RUNTIME_API
    monkeypatch.setattr(interface, "RUNTIME_API", new - 1)
    monkeypatch.setitem(sys.modules, "autoplan.procs", None)
    monkeypatch.delattr(runtime, "exit_skipping_teardown")
    monkeypatch.delattr(runtime, "load_source")
    monkeypatch.setattr(sys, "argv", ["/some/dir/train.py"])
    path = TEMPLATE
    if program == "golden":
        path = tmp_path / "train.py"
        path.write_text(render_golden_plan())
    with pytest.raises(SystemExit) as exited:
        load_module(path, f"autoplan_train_on_an_older_autoplan_{program}")
    assert exited.value.code == runtime.MISMATCH_EXIT_CODE == 2
    assert capsys.readouterr().err.splitlines() == [f"train.py: error: {runtime.runtime_api_mismatch(new)}"]
    assert f"generated for autoplan runtime API {new}," in runtime.runtime_api_mismatch(new)
    assert f"provides runtime API {new - 1}:" in runtime.runtime_api_mismatch(new)


def reference_run(program_dir: Path) -> subprocess.CompletedProcess:
    """autoplan verify's single-device reference run of `program_dir`/train.py, 1 step on CPU (runtime/harness/reference.py)."""
    return subprocess.run([sys.executable, "-m", "autoplan.runtime.harness.reference", "train.py", "--", "--steps", "1",
                           "--device", "cpu"], cwd=program_dir, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_program_for_another_runtime_api_stops_before_building_anything(tmp_path):
    plan = make_plan(dp_replicate=1, pp=1, stages=[["inp", "out"]],
                     microbatches=2, microbatch=8)
    write_program(plan, tmp_path, MLP)
    matching = reference_run(tmp_path)
    assert matching.returncode == 0 and "step 0 | loss" in matching.stdout, matching.stderr

    train_py = tmp_path / "train.py"
    line = f"RUNTIME_API = {runtime.RUNTIME_API}  #"
    assert train_py.read_text().count(line) == 1
    train_py.write_text(train_py.read_text().replace(line, f"RUNTIME_API = {runtime.RUNTIME_API + 1}  #"))
    other = reference_run(tmp_path)
    assert other.returncode == 2 and other.stdout == ""
    assert other.stderr.splitlines() == [f"train.py: error: {runtime.runtime_api_mismatch(runtime.RUNTIME_API + 1)}"]


@pytest.mark.slow
def test_a_built_wheel_ships_the_template_and_renders_from_it(tmp_path, built_wheel):
    assert built_wheel.wheel.read("autoplan/codegen/templates/train.py").decode() == TEMPLATE.read_text()
    site = built_wheel.site
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import autoplan.codegen.template as t; "
            "print(t.__file__); print(t.template_text() == open(sys.argv[2]).read())")
    run = subprocess.run([sys.executable, "-c", code, str(site), str(TEMPLATE)], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(site / "autoplan" / "codegen" / "template.py"), "True"]
