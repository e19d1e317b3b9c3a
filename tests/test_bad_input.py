"""Bad models, bad hardware files and infeasible requests: one clear line, exit 2, no output folder."""

import json
from pathlib import Path

import pytest

from autoplan.cli import main

MODELS = Path(__file__).parent / "models"

NOT_A_MODULE = """
import torch
def build_model(): return 42
def example_batch(b): return torch.randn(b, 4), torch.randn(b, 2)
"""
WRONG_SHAPE = """
import torch
def build_model(): return torch.nn.Linear(4, 2)
def example_batch(b): return torch.randn(b, 7), torch.randn(b, 2)
"""
RAISES = """
import torch
def build_model():
    raise RuntimeError("weights not found at /data/x")
def example_batch(b): return torch.randn(b, 4), torch.randn(b, 2)
"""
DATA_DEPENDENT = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)
    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)
def build_model(): return M()
def example_batch(b): return torch.randn(b, 4), torch.randn(b, 2)
"""


ONE_MODULE = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)
    def forward(self, x):
        return self.out(self.act(self.fc(self.act(self.fc(x)))))  # fc runs again after act
def build_model(): return M()
def example_batch(b): return torch.randn(b, 8), torch.randn(b, 2)
"""

ODD_PAIR = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 15), torch.nn.Linear(15, 8)
    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
def build_model(): return M()
def example_batch(b): return torch.randn(b, 8), torch.randn(b, 8)
"""


def run(tmp_path, capsys, *args) -> tuple[int, str]:
    code = main([*map(str, args), "--out", str(tmp_path / "out"), "--quiet"])
    return code, capsys.readouterr().err


def model_file(tmp_path, text) -> Path:
    path = tmp_path / "model.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    (NOT_A_MODULE, "build_model() must return a torch.nn.Module, got int"),
    (WRONG_SHAPE, "[2, 7] X [4, 2]"),
    (RAISES, "build_model() in model.py raised (model.py:4): RuntimeError: weights not found at /data/x"),
])
def test_broken_models(tmp_path, capsys, text, message):
    code, err = run(tmp_path, capsys, model_file(tmp_path, text), "--gpus", "2", "--gpu", "cpu")
    assert code == 2 and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unknown_gpu_lists_the_known_ones(tmp_path, capsys):
    code, err = run(tmp_path, capsys, MODELS / "tiny_mlp.py", "--gpus", "2", "--gpu", "h900")
    assert code == 2 and "h900" in err and "h100-sxm5-80gb" in err and "a100-sxm4-80gb" in err


@pytest.mark.parametrize("text, message", [
    ("gpu: [\n", "not valid YAML"),
    ("name: x\ndefault_gpus_per_node: 8\n", "gpu"),
])
def test_bad_hardware_profile_names_file_and_field(tmp_path, capsys, text, message):
    hw = tmp_path / "hw.yaml"
    hw.write_text(text)
    code, err = run(tmp_path, capsys, MODELS / "tiny_mlp.py", "--gpus", "2", "--hardware", hw)
    assert code == 2 and "hw.yaml" in err and message in err


def test_infeasible_names_the_memory_and_gpu_count_that_would_fit(tmp_path, capsys):
    code, err = run(tmp_path, capsys, MODELS / "tiny_gpt.py", "--gpus", "2", "--gpu", "cpu", "--memory-per-gpu", "64KiB")
    assert code == 2 and "no layout fits" in err
    assert "needs" in err and "GiB per GPU" in err
    assert not (tmp_path / "out").exists()


def test_pin_that_does_not_divide_shows_the_arithmetic(tmp_path, capsys):
    code, err = run(tmp_path, capsys, MODELS / "tiny_mlp.py", "--gpus", "4", "--gpu", "cpu", "--pin", "pp=3")
    assert code == 2 and "pp=3" in err and "4" in err


def test_data_dependent_control_flow_still_plans_without_pipelines(tmp_path, capsys):
    path = model_file(tmp_path, DATA_DEPENDENT)
    code, err = run(tmp_path, capsys, path, "--gpus", "2", "--gpu", "cpu")
    assert code == 0, err
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["parallelism"]["pipeline_parallel_degree"] == 1
    # the module and the line where torch.export failed (`if h.sum() > 0:`, line 10 of the file)
    where = f"(in module the model's root (M), at {path.name}:10 in forward)"
    unsupported = (tmp_path / "out" / "unsupported_ops.txt").read_text()
    assert "## dimensions not planned\nno pipeline parallelism (pp=1): " in unsupported and where in unsupported
    code, err = run(tmp_path, capsys, path, "--gpus", "2", "--gpu", "cpu", "--pin", "pp=2")
    assert code == 2 and "pp=2 needs the model's graph from torch.export" in err and where in err
    assert err.strip().splitlines()[-1].startswith("autoplan: error: pp=2 needs")


@pytest.mark.parametrize("text, pin, line", [
    (ONE_MODULE, "pp=2", "no pipeline parallelism (pp=1): the model stays one module: its child module 'fc' runs "
                         "again after 'act' started, so no stage boundary can fall between them"),
    (ODD_PAIR, "tp=2", "no tensor parallelism (tp=1): tp=2 does not divide in_features 15 of down"),
])
def test_a_dimension_the_model_cannot_take_is_left_out_with_the_module_and_why(tmp_path, capsys, text, pin, line):
    path = model_file(tmp_path, text)
    code, err = run(tmp_path, capsys, path, "--gpus", "2", "--gpu", "cpu")
    assert code == 0, err
    assert f"## dimensions not planned\n{line}\n" in (tmp_path / "out" / "unsupported_ops.txt").read_text()
    assert f"autoplan: planning with {line}" in err
    code, err = run(tmp_path, capsys, path, "--gpus", "2", "--gpu", "cpu", "--pin", pin)
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"autoplan: error: pins cannot hold: {pin}")
    assert line.split(": ", 1)[1].split("tp=2 ")[-1] in err


def test_verify_rejects_a_tampered_plan(tmp_path, capsys):
    code, _ = run(tmp_path, capsys, MODELS / "tiny_mlp.py", "--gpus", "2", "--gpu", "cpu")
    assert code == 0
    plan_path = tmp_path / "out" / "plan.json"
    raw = json.loads(plan_path.read_text())
    raw["schema_version"] = 999
    plan_path.write_text(json.dumps(raw))
    assert main(["verify", str(tmp_path / "out")]) == 2
    assert "schema_version" in capsys.readouterr().err
