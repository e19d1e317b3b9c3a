"""The tensor-parallel pair finder on real captures: a residual that reads a Linear's output is not a
colwise -> rowwise pair (the sum would mix split and whole tensors); Linear -> GELU -> Linear is."""

from pathlib import Path

from autoplan.api import ProfileOptions, profile_only
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
    profile = profile_only(str(examples / "mlp.py"), "cpu", ProfileOptions(measure=False))
    assert find_tensor_parallel_plan(profile, vocab_parallel=False) == {}


def test_up_gelu_down_is_a_pair(tmp_path):
    model = tmp_path / "paired.py"
    model.write_text(PAIRED)
    profile = profile_only(str(model), "cpu", ProfileOptions(measure=False))
    assert find_tensor_parallel_plan(profile, vocab_parallel=False) == {
        "0.up": "colwise", "0.down": "rowwise", "1.up": "colwise", "1.down": "rowwise"}


def test_gpt2_conv1d_mlp_is_a_pair_and_its_fused_qkv_is_not(tmp_path):
    """transformers' Conv1D (addmm of an [in, out] weight, output viewed back to [b, s, features]) pairs like
    a Linear; c_attn's fused q, k, v, split after that view, stays whole as examples/gpt.py's qkv does."""
    model = tmp_path / "tiny_gpt2.py"
    model.write_text(f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("gpt2", {str(Path(__file__).resolve().parents[1] / "examples" / "hf_gpt2.py")!r})
gpt2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt2)
gpt2.VOCAB, gpt2.HIDDEN, gpt2.LAYERS, gpt2.HEADS, gpt2.SEQ_LEN = 64, 16, 2, 2, 8
build_model, example_batch, loss_fn = gpt2.build_model, gpt2.example_batch, gpt2.loss_fn
""")
    profile = profile_only(str(model), "cpu", ProfileOptions(measure=False))
    assert find_tensor_parallel_plan(profile, vocab_parallel=False, fused_split=False) == {
        f"transformer.h.{i}.mlp.{name}": style for i in range(2) for name, style in (("c_fc", "colwise"),
                                                                                      ("c_proj", "rowwise"))}
    megatron = find_tensor_parallel_plan(profile, vocab_parallel=False)  # Megatron-LM's interleaved fused qkv
    assert megatron["transformer.h.0.attn.c_attn"] == "colwise" and megatron["transformer.h.0.attn.c_proj"] == "rowwise"
