"""Model files as users have them: a wrapper beside nanoGPT's model.py (`from model import GPT`), a wrapper
beside minGPT's mingpt/ package, a model file inside a package (relative imports), helpers that import the
model file by its name. Each is imported as Python imports it, the output folder's model_code/ copies the files
it imports, and the copy (or, with --model-file planned, the original) plans and verifies through the plain CLI.

The fixtures under tests/fixtures/ are look-alikes of karpathy/nanoGPT and minGPT (their shapes: GPT(GPTConfig)
with a fused c_attn, forward(idx, targets=None) returning (logits, loss); mingpt/model.py importing
mingpt.utils, (logits, None) without targets), written for these tests."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoplan.codegen.program import MODEL_COPY_DIR, copy_model_files, find_model_copy
from autoplan.errors import UserError
from autoplan.contract import call_user, load_source, local_files

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
NANOGPT = FIXTURES / "nanogpt" / "wrapper.py"
MINGPT = FIXTURES / "mingpt" / "wrapper.py"
PACKAGED = FIXTURES / "packaged" / "tinylm" / "plan.py"


def write_files(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def relative(files, root: Path) -> set[str]:
    return {Path(f).relative_to(root).as_posix() for f in files}


def test_local_files_follow_the_imports_beside_the_model_file():
    assert relative(local_files(NANOGPT), NANOGPT.parent) == {"wrapper.py", "model.py"}
    assert relative(local_files(MINGPT), MINGPT.parent) == {
        "wrapper.py", "mingpt/__init__.py", "mingpt/model.py", "mingpt/utils.py"}
    assert relative(local_files(PACKAGED), PACKAGED.parents[1]) == {
        "tinylm/__init__.py", "tinylm/plan.py", "tinylm/layers.py"}


def test_lazy_and_from_imports_are_followed_and_libraries_are_not(tmp_path):
    write_files(tmp_path, {
        "entry.py": """
            import torch
            from pkg import sub
            def build_model():
                import lazy
                return lazy.make()
        """,
        "lazy.py": "from helpers.deep import x\n",
        "pkg/__init__.py": "", "pkg/sub.py": "", "pkg/unused.py": "",
        "helpers/deep.py": "x = 1\n",  # a namespace package (no __init__.py)
        "unrelated.py": "",
    })
    assert relative(local_files(tmp_path / "entry.py"), tmp_path) == {
        "entry.py", "pkg/__init__.py", "pkg/sub.py", "lazy.py", "helpers/deep.py"}


def test_the_copy_of_a_wrapper_beside_model_py_imports_its_neighbour(tmp_path):
    """The output folder's copy was model.py itself: `from model import GPT` imported the wrapper's copy
    (a circular import)."""
    copied = copy_model_files(NANOGPT, tmp_path / MODEL_COPY_DIR)
    assert copied == Path("wrapper.py")
    assert sorted(p.name for p in (tmp_path / MODEL_COPY_DIR).iterdir()) == ["model.py", "wrapper.py"]
    load_source(str(NANOGPT)).build_model()  # the original first: its `model` is in sys.modules now
    source = load_source(str(tmp_path / MODEL_COPY_DIR / "wrapper.py"))
    model = source.build_model()
    assert Path(sys.modules[type(model).__module__].__file__) == tmp_path / MODEL_COPY_DIR / "model.py"


def test_a_package_beside_the_wrapper_is_copied_and_imported(tmp_path):
    copy_model_files(MINGPT, tmp_path / MODEL_COPY_DIR)
    source = load_source(str(tmp_path / MODEL_COPY_DIR / "wrapper.py"))
    logits, loss = source.build_model()(source.example_batch(2)[0])
    assert loss is None and tuple(logits.shape) == (2, 16, 64)
    assert sys.modules["mingpt.model"].__file__ == str(tmp_path / MODEL_COPY_DIR / "mingpt" / "model.py")


def test_a_model_file_inside_a_package_is_imported_as_its_module(tmp_path):
    """tinylm/plan.py does `from .layers import TinyLM`: only importable as tinylm.plan."""
    source = load_source(str(PACKAGED))
    assert source.module.__name__ == "tinylm.plan"
    assert source.build_model().head.out_features == 32
    copied = copy_model_files(PACKAGED, tmp_path / MODEL_COPY_DIR)
    assert copied == Path("tinylm/plan.py")
    assert load_source(str(tmp_path / MODEL_COPY_DIR / copied)).module.__file__ == str(tmp_path / MODEL_COPY_DIR / copied)


def test_the_copy_of_the_planned_file_is_found_among_files_of_its_name(tmp_path):
    """autoplan.model_copy (the recipes' default model file): the planned file's copy, not another file of
    its name in a package beside it (minGPT's wrapper named model.py beside mingpt/model.py)."""
    source_dir = tmp_path / "src"
    write_files(source_dir, {"model.py": "from mingpt.model import GPT\n", "mingpt/__init__.py": "",
                             "mingpt/model.py": "GPT = 1\n"})
    out = tmp_path / "out"
    copy_model_files(source_dir / "model.py", out / MODEL_COPY_DIR)
    assert find_model_copy(out, (source_dir / "model.py").resolve()) == out / MODEL_COPY_DIR / "model.py"
    packaged = (source_dir / "mingpt" / "model.py").resolve()
    copy_model_files(source_dir / "mingpt" / "model.py", tmp_path / "out2" / MODEL_COPY_DIR)
    assert find_model_copy(tmp_path / "out2", packaged) == tmp_path / "out2" / MODEL_COPY_DIR / "mingpt" / "model.py"
    with pytest.raises(UserError, match="holds no copy of model.py"):
        find_model_copy(tmp_path / "elsewhere", source_dir / "model.py")


def test_a_helper_importing_the_model_file_gets_the_same_module(tmp_path):
    """The model file is registered under its own name: a neighbour's `import model` is that module, not a
    second execution of the file (which here would be a circular import)."""
    write_files(tmp_path, {
        "model.py": """
            import torch
            from neighbour import make
            WIDTH = 3
            def build_model():
                return make()
            def example_batch(batch_size):
                return torch.randn(batch_size, WIDTH), torch.randn(batch_size, 2)
        """,
        "neighbour.py": """
            import torch
            import model
            def make():
                return torch.nn.Linear(model.WIDTH, 2)
        """,
    })
    source = load_source(str(tmp_path / "model.py"))
    assert source.build_model().in_features == 3 and sys.modules["model"] is source.module


def test_each_model_folder_imports_its_own_neighbours(tmp_path):
    """Two folders with a wrapper.py and a model.py each, loaded in one process: the second imports its own
    model.py, not the first one's cached module."""
    for width in (3, 5):
        write_files(tmp_path / f"w{width}", {
            "wrapper.py": """
                import torch
                from model import WIDTH
                def build_model():
                    return torch.nn.Linear(WIDTH, 2)
                def example_batch(batch_size):
                    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, 2)
            """,
            "model.py": f"WIDTH = {width}\n",
        })
    assert [load_source(str(tmp_path / f"w{w}" / "wrapper.py")).build_model().in_features for w in (3, 5)] == [3, 5]


def test_an_error_in_a_neighbour_names_that_file(tmp_path):
    write_files(tmp_path, {
        "wrapper.py": """
            from lib.layers import make
            def build_model():
                return make()
            def example_batch(batch_size):
                return None, None
        """,
        "lib/__init__.py": "",
        "lib/layers.py": """
            def make():
                config = {}
                return config["n_layer"]
        """,
    })
    source = load_source(str(tmp_path / "wrapper.py"))
    with pytest.raises(UserError, match=r"^build_model\(\) in wrapper\.py raised \(lib/layers\.py:4\): KeyError"):
        call_user(source, "build_model()", source.build_model)


def test_a_missing_neighbour_is_not_sent_to_pip(tmp_path):
    write_files(tmp_path, {"wrapper.py": "from mingpt.model import GPT\n"})
    with pytest.raises(UserError, match=rf"^wrapper\.py imports mingpt, which is not installed and not a module or "
                                        rf"package in {tmp_path}$"):
        load_source(str(tmp_path / "wrapper.py"))


def autoplan_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m autoplan ARGS` as a user runs it (this checkout's autoplan first on the path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def plan_and_verify(model: Path, out: Path, pin: str, *verify_args: str) -> dict:
    planned = autoplan_cli(str(model), "--gpus", "2", "--gpu", "cpu", "--pin", pin, "--out", str(out), "--quiet")
    assert planned.returncode == 0, planned.stderr
    verified = autoplan_cli("verify", str(out), *verify_args)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] and report["parity_max_abs_diff"] <= report["parity_tolerance"]
    assert report["gradient_max_rel_diff"] <= report["gradient_tolerance"]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("model, pin", [(NANOGPT, "dp=2"), (MINGPT, "dp=2"), (NANOGPT, "tp=2"), (MINGPT, "tp=2"),
                                        (NANOGPT, "pp=2"), (MINGPT, "pp=2")],
                         ids=["nanogpt-dp2", "mingpt-dp2", "nanogpt-tp2", "mingpt-tp2", "nanogpt-pp2", "mingpt-pp2"])
def test_wrappers_beside_nanogpt_and_mingpt_plan_and_verify(tmp_path, model, pin):
    """The plain CLI on the thinnest wrappers users write beside nanoGPT's model.py and minGPT's package:
    plan, then verify (minGPT returns (logits, None): the pipeline carries the None)."""
    report = plan_and_verify(model, tmp_path / "out", pin)
    assert report["model_file"] == "copy"
    assert (tmp_path / "out" / MODEL_COPY_DIR / "wrapper.py").read_bytes() == model.read_bytes()


@pytest.mark.slow
def test_verify_runs_the_planned_file_in_place(tmp_path):
    """--model-file planned: both runs import the original tinylm/plan.py (its package beside it), not the copy
    (removed here to prove it)."""
    out = tmp_path / "out"
    planned = autoplan_cli(str(PACKAGED), "--gpus", "2", "--gpu", "cpu", "--pin", "dp=2", "--out", str(out), "--quiet")
    assert planned.returncode == 0, planned.stderr
    for path in sorted((out / MODEL_COPY_DIR).rglob("*.py")):
        path.unlink()
    verified = autoplan_cli("verify", str(out), "--model-file", "planned")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads((out / "verify.json").read_text())["model_file"] == "planned"


@pytest.mark.slow
def test_a_failed_verify_records_why_and_names_the_users_file(tmp_path):
    """The distributed run fails in the model's forward: verify.json says so (passed false, the error) and the
    first exception names the file by the user's name, in the output folder's copy."""
    write_files(tmp_path / "src", {
        "net.py": """
            import os
            import torch

            def build_model():
                return Net()

            def example_batch(batch_size):
                return torch.randn(batch_size, 4), torch.randn(batch_size, 2)

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.proj = torch.nn.Linear(4, 2)

                def forward(self, x):
                    if os.environ.get("RANK") == "1":  # only rank 1 of the distributed run
                        raise ValueError("rank 1 cannot")
                    return self.proj(x)
        """,
    })
    out = tmp_path / "out"
    planned = autoplan_cli(str(tmp_path / "src" / "net.py"), "--gpus", "2", "--gpu", "cpu", "--pin", "dp=2",
                           "--out", str(out), "--quiet")
    assert planned.returncode == 0, planned.stderr
    verified = autoplan_cli("verify", str(out))
    assert verified.returncode == 2
    first = f"first exception: ValueError: rank 1 cannot (rank 1, at {out}/model_code/net.py:18 in forward)\n"
    assert first in verified.stderr, verified.stderr
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] is False and report["parity_max_abs_diff"] is None
    assert first in report["error"]
    assert "rank 1 cannot" in (out / "report.html").read_text()


def test_verify_model_file_planned_needs_the_planned_file(tmp_path):
    from test_codegen import make_plan

    from autoplan.plan import ModelRef
    from autoplan.verify import VerifySettings, verify

    out = tmp_path / "out"
    out.mkdir()
    plan = make_plan(model=ModelRef(path=str(tmp_path / "gone.py")), dp_replicate=2,
                     pp=1, stages=[["inp", "out"]])
    (out / "plan.json").write_text(plan.to_json())
    (out / "train.py").write_text("# --model-file\n")
    with pytest.raises(UserError, match=r"--model-file planned runs .*gone\.py, the file this plan was made from, "
                                        r"which is not there now"):
        verify(out, VerifySettings(model_file="planned"))
    assert not (out / "verify.json").exists()  # bad input, not a failed run
