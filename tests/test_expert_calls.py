"""The experts modules of a pipeline split for expert parallelism (runtime/distributed/expert_calls.py): exported as one opaque
experts_call per module, then called again as the model's own module inside the stage, at its FQN under the chain
module, with its parameters under the model's names. Two stages chained match the whole model, forward and
backward, on HF OLMoE and Qwen2-MoE (a shared expert beside the experts) from config and examples/mixtral.py
shrunk (grouped-matmul experts). One process, no torch.distributed."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import fx

from autoplan.capture.experts import is_experts_module
from autoplan.errors import UserError
from autoplan.runtime import split_model
from autoplan.runtime.distributed.expert_calls import EXPERTS_CALL, experts_as_calls

from test_runtime import run_stages, stage_grads

ROOT = Path(__file__).resolve().parents[1]
STAGES = [("model.embed_tokens", "model.layers.0"), ("model.layers.1", "model.norm", "lm_head")]
FINE_STAGES = [("model.embed_tokens", "model.rotary_emb", "model.layers.0.input_layernorm", "model.layers.0.self_attn"),
               ("model.layers.0.post_attention_layernorm", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts",
                "model.layers.1.input_layernorm"),
               ("model.layers.1.self_attn", "model.layers.1.post_attention_layernorm", "model.layers.1.mlp.gate"),
               ("model.layers.1.mlp.experts", "model.norm", "lm_head")]
"""Stages as the search cut the tiny Mixtral for pp=2 x 2 virtual stages: the experts modules are chain modules."""


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name: str):
    torch.manual_seed(0)
    if name == "mixtral":
        mixtral = load(ROOT / "examples" / "mixtral.py", "autoplan_test_calls_mixtral")
        model = mixtral.build_model(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    max_position_embeddings=8)
        return model, torch.randint(0, 64, (2, 8))
    zoo = load(ROOT / "benchmarks" / "zoo" / "causal_lm.py", "autoplan_test_calls_zoo")
    return getattr(zoo, name)(), zoo.example_batch(2)[0]["input_ids"]


@pytest.mark.parametrize("name", ["olmoe", "qwen2_moe", "mixtral"])
def test_stages_call_the_experts_modules_and_chained_match_the_model(name):
    model, ids = build(name)
    split = assert_chained_stages_match_the_model(model, ids, STAGES)
    for k, stage in enumerate(split.stages):
        layer = stage.get_submodule(f"model.layers.{k}")
        assert isinstance(layer, fx.GraphModule)
        assert [n.target for n in layer.graph.nodes if n.op == "call_module"] == ["mlp.experts"]
        assert layer.get_submodule("mlp.experts") is model.get_submodule(f"model.layers.{k}.mlp.experts")
        assert not any(n.target is EXPERTS_CALL for n in layer.graph.nodes)
        names = split.parameter_fqns[k]
        assert names[f"model.layers.{k}.mlp.experts.down_proj"] == f"model.layers.{k}.mlp.experts.down_proj"


def test_an_experts_module_that_is_a_chain_module_is_called_as_that_chain_module():
    model, ids = build("mixtral")
    split = assert_chained_stages_match_the_model(model, ids, FINE_STAGES)
    for k, layer in ((1, 0), (3, 1)):
        fqn = f"model.layers.{layer}.mlp.experts"
        assert fqn in split.chain_modules[k] and split.stages[k].get_submodule(fqn) is model.get_submodule(fqn)
        assert split.state_fqns[k][f"{fqn}.gate_up_proj"] == f"{fqn}.gate_up_proj"
    assert not any(".experts." in name for k in (0, 2) for name in split.parameter_fqns[k])


def assert_chained_stages_match_the_model(model, ids, stages):
    """Split with the experts as modules; the stages chained give the model's logits and gradients."""
    reference = copy.deepcopy(model)
    expected = reference(input_ids=ids).logits
    expected.square().mean().backward()
    split = split_model(model, {"input_ids": ids}, stages, experts_as_modules=True)
    logits = split.unflatten_output(run_stages(split, {"input_ids": ids})).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    logits.square().mean().backward()
    grads, reference_params = stage_grads(split), dict(reference.named_parameters())
    assert set(grads) == set(reference_params)
    for fqn, grad in grads.items():
        torch.testing.assert_close(grad, reference_params[fqn].grad, rtol=1e-4, atol=1e-6, msg=fqn)
    return split


def test_the_experts_run_their_own_forward_again_after_the_export():
    model, ids = build("olmoe")
    experts = model.get_submodule("model.layers.0.mlp.experts")
    with experts_as_calls(model) as found:
        assert list(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert all(is_experts_module(m) for m in found.values()) and "forward" in vars(experts)
    assert "forward" not in vars(experts)
    hidden = torch.randn(3, 64)
    index, weights = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), 0.5)
    assert experts(hidden, index, weights).shape == (3, 64)


def test_without_experts_as_modules_the_experts_ops_stay_inlined():
    model, ids = build("olmoe")
    split = split_model(model, {"input_ids": ids}, STAGES)
    layer = split.stages[0].get_submodule("model.layers.0")
    assert not [n for n in layer.graph.nodes if n.op == "call_module"]


def test_experts_as_modules_of_a_model_without_experts_is_refused_in_one_line():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(UserError, match=r"^expert parallelism, but Sequential has no experts module .* plan it with "
                                        r"ep=1$"):
        split_model(model, torch.randn(2, 4), [("0",)], experts_as_modules=True)
