"""chain.experts: the expert layers of transformers' MoE families found in the captured graph (router,
stacked expert weights, E, k, the rows an all-to-all would move), and none in a dense model."""

from pathlib import Path

import pytest

from autoplan.chain.experts import expert_layers
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_model
from autoplan.contract import load_source

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo" / "causal_lm.py"
BATCH = 2
SEQ = 32  # benchmarks/zoo/causal_lm.py's SEQ_LEN


@pytest.fixture(scope="module")
def hardware():
    return load_hardware("h100-sxm5-80gb")


@pytest.mark.parametrize("family, experts, top_k, expert_numel", [
    ("olmoe", 8, 2, 8 * 3 * 64 * 32),       # 8 experts of gate, up (64 -> 32) and down (32 -> 64)
    ("qwen2_moe", 4, 2, 4 * 3 * 64 * 32),   # the shared expert is a plain MLP, not stacked
    ("mixtral_moe", 4, 2, None),
])
def test_moe_families_have_one_expert_layer_per_block(hardware, family, experts, top_k, expert_numel):
    profile = profile_model(load_source(f"{ZOO}:{family}"), BATCH, hardware, measure=False, dtype="bf16")
    layers = expert_layers(profile)
    assert [layer.module for layer in layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for i, layer in enumerate(layers):
        assert layer.router == f"model.layers.{i}.mlp.gate"
        assert layer.parameters == (f"model.layers.{i}.mlp.experts.down_proj", f"model.layers.{i}.mlp.experts.gate_up_proj")
        assert (layer.num_experts, layer.top_k, layer.tokens, layer.hidden) == (experts, top_k, BATCH * SEQ, 64)
        assert layer.parameter_numel == sum(profile.parameters[name] for name in layer.parameters)
        if expert_numel is not None:
            assert layer.parameter_numel == expert_numel


def test_a_dense_model_has_no_expert_layer(hardware):
    profile = profile_model(load_source(f"{ZOO}:qwen2"), BATCH, hardware, measure=False, dtype="bf16")
    assert expert_layers(profile) == ()
