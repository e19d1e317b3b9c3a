"""The tensor-parallel pair finder on real captures: a residual that reads a Linear's output is not a
colwise -> rowwise pair (the sum would mix split and whole tensors); Linear -> GELU -> Linear is."""

from pathlib import Path

from autoplan.api import profile_only
from autoplan.chain.tensor_parallel import find_tensor_parallel_plan

PAIRED = """
import torch
from torch import nn
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))
def build_model():
    return nn.Sequential(Block(), Block())
def example_batch(b):
    return torch.randn(b, 32), torch.randn(b, 32)
"""


def test_a_linear_feeding_a_residual_is_not_split(tmp_path):
    examples = Path(__file__).resolve().parents[1] / "examples"
    profile = profile_only(str(examples / "mlp.py"), "cpu", measure=False)
    assert find_tensor_parallel_plan(profile, vocab_parallel=False) == {}


def test_up_gelu_down_is_a_pair(tmp_path):
    model = tmp_path / "paired.py"
    model.write_text(PAIRED)
    profile = profile_only(str(model), "cpu", measure=False)
    assert find_tensor_parallel_plan(profile, vocab_parallel=False) == {
        "0.up": "colwise", "0.down": "rowwise", "1.up": "colwise", "1.down": "rowwise"}
