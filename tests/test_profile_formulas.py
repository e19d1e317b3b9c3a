"""The profile against the literature (shared/reference/formulas.md): parameter count and model FLOPs
of a GPT (Narayanan et al. 2021), activation bytes per layer (Korthikanti et al. 2022, Table 2)."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoplan.api import PlanOptions, plan_model
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_model
from autoplan.contract import ModelSource, load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SEQ, HIDDEN, HEADS, LAYERS, VOCAB, BATCH = 128, 128, 4, 2, 256, 2
"""The Megatron-style GPT below: s, h, a, l, V and the profiled batch b."""


class Attention(nn.Module):
    """GPT-2 attention with dropout: materialized scores ("math") or the fused kernel ("flash")."""

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.attn_drop = nn.Dropout(0.1)
        self.resid_drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in self.qkv(x).split(h, dim=2))
        if self.kernel == "flash":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // HEADS))
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            y = self.attn_drop(F.softmax(scores, dim=-1)) @ v
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, s, h)))


class Block(nn.Module):
    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention(kernel)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.out = nn.Linear(4 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)))))


class MegatronGPT(nn.Module):
    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(kernel) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _megatron_source(kernel: str) -> ModelSource:
    def build_model():
        return MegatronGPT(kernel).to(torch.bfloat16)  # Korthikanti's bytes are for 16-bit activations

    def example_batch(batch_size):
        return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))

    return ModelSource(Path(f"megatron_{kernel}.py"), "build_model", None, build_model, example_batch, None)


@pytest.mark.parametrize("kernel, attention_term", [("math", 5 * HEADS * SEQ / HIDDEN), ("flash", 0.0)])
def test_activation_bytes_per_layer_match_korthikanti(kernel, attention_term):
    """s b h (34 + 5 a s / h) bytes per layer with materialized attention scores; the fused (flash)
    kernel keeps no s x s matrix, which leaves 34 s b h (the paper's selective-recompute figure)."""
    profile = profile_model(_megatron_source(kernel), BATCH, load_hardware("h100-sxm5-80gb"), measure=False,
                            dtype="bf16")
    per_layer = [sum(o.saved_bytes for o in profile.ops if f"blocks.{i}" in o.module_stack) for i in range(LAYERS)]
    expected = SEQ * BATCH * HIDDEN * (34 + attention_term)
    for saved in per_layer:
        assert saved == pytest.approx(expected, rel=0.10)
    assert per_layer[0] == per_layer[1]


def _gpt_formulas(source):
    m = source.module
    layers, h, s, vocab = m.N_LAYER, m.N_EMBD, m.SEQ_LEN, m.VOCAB
    parameters = 12 * layers * h**2 * (1 + 13 / (12 * h) + (vocab + s) / (12 * layers * h))
    model_flops_per_sample = 72 * layers * s * h**2 * (1 + s / (6 * h) + vocab / (12 * h * layers))
    return parameters, model_flops_per_sample


def test_gpt_parameters_equal_the_closed_form_plus_the_final_norm():
    source = load_source(str(EXAMPLES / "gpt.py"))
    profile = profile_model(source, 2, load_hardware("h100-sxm5-80gb"), measure=False)
    parameters, _ = _gpt_formulas(source)
    assert profile.param_count == parameters + 2 * source.module.N_EMBD  # formulas.md leaves out ln_f


@pytest.mark.parametrize("global_batch", [8, 24])
def test_model_flops_per_step_match_narayanan(global_batch):
    """72 B l s h^2 (1 + s/(6h) + V/(12 h l)): forward + backward, no recompute, at the global batch."""
    source = load_source(str(EXAMPLES / "gpt.py"))
    plan = plan_model(source, 8, "h100-sxm5-80gb", PlanOptions(global_batch=global_batch)).plan
    _, per_sample = _gpt_formulas(source)
    assert plan.predicted.model_flops_per_step == pytest.approx(global_batch * per_sample, rel=0.03)


def test_model_flops_of_hugging_face_gpt2_match_narayanan():
    source = load_source(str(EXAMPLES / "hf_gpt2.py"))
    m = source.module
    m.VOCAB, m.HIDDEN, m.LAYERS, m.HEADS, m.SEQ_LEN = 512, 128, 2, 4, 64
    plan = plan_model(source, 8, "h100-sxm5-80gb", PlanOptions(global_batch=16)).plan
    per_sample = 72 * m.LAYERS * m.SEQ_LEN * m.HIDDEN**2 * (
        1 + m.SEQ_LEN / (6 * m.HIDDEN) + m.VOCAB / (12 * m.HIDDEN * m.LAYERS))
    assert plan.predicted.model_flops_per_step == pytest.approx(16 * per_sample, rel=0.03)
