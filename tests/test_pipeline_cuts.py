"""Pipeline cuts the program can run (issue 26, item 3), in one process: stages chained by hand equal the model,
forward and first-step gradients, for the models that planned a pipeline and then failed in the program:
a minGPT look-alike whose forward returns (logits, None), a torchtitan-style Llama cut inside its attention (a
transposed query crossing the cut), and a Hugging Face Llama from a plain LlamaConfig (use_cache left True, so its
output holds a DynamicCache)."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from autoplan.contract import call_model, default_loss
from autoplan.runtime import split_model
from autoplan.runtime.distributed.stage_graph import SendLayout

MODELS = Path(__file__).parent / "models"


def load_model_file(name: str, **constants):
    spec = importlib.util.spec_from_file_location(f"autoplan_test_cuts_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for key, value in constants.items():
        setattr(module, key, value)
    return module


def chained(split, inputs) -> tuple:
    """The last stage's outputs, each stage fed what the one before sends: contiguous tensors of the shapes in
    boundary_meta (what PipelineStage's receive buffers are)."""
    values = split.flatten_inputs(inputs)
    for k, stage in enumerate(split.stages):
        values = stage(*values)
        metas = split.boundary_meta[k + 1]
        assert [tuple(v.shape) for v in values] == [meta[0] for meta in metas]
        assert all(v.is_contiguous() for v in values)  # what isend takes
    return values


def assert_stages_match_model(model: nn.Module, stages, inputs, targets, loss_fn=default_loss):
    """Stages chained = the model: the output, then every parameter's gradient of the loss."""
    reference = copy.deepcopy(model)  # the split shares the model's tensors: keep the gradients apart
    expected = call_model(reference, inputs)
    loss_fn(expected, targets).backward()
    split = split_model(model, inputs, stages)
    flat = chained(split, inputs)
    output = split.unflatten_output(flat)
    split.loss(loss_fn)(flat, targets).backward()
    grads: dict[str, torch.Tensor] = {}
    for stage, names in zip(split.stages, split.parameter_fqns):
        params = dict(stage.named_parameters())
        for name, fqn in names.items():
            grads[fqn] = grads.get(fqn, 0) + params[name].grad
    reference_params = dict(reference.named_parameters())
    assert set(grads) == set(reference_params)
    for fqn, grad in grads.items():
        torch.testing.assert_close(grad, reference_params[fqn].grad, rtol=1e-5, atol=1e-6, msg=fqn)
    return split, output, expected


def test_a_forward_returning_logits_and_none_is_cut_and_the_none_carried():
    gpt = load_model_file("loss_inside_gpt")
    torch.manual_seed(0)
    inputs, targets = gpt.example_batch(2)
    first = ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1"]
    split, output, expected = assert_stages_match_model(
        gpt.build_model(), [first, ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]],
        inputs, targets)
    assert expected[1] is None and isinstance(output, tuple) and output[1] is None
    torch.testing.assert_close(output[0], expected[0], rtol=0, atol=1e-6)
    # the last stage returns the logits alone: the None is not a tensor to hand on
    assert split.boundary_meta[-1] == (((2, gpt.BLOCK, gpt.VOCAB), torch.float32, True),)


def titan_chain(titan) -> list[str]:
    """The torchtitan-style Llama's chain modules in the order the model runs them (the planner's chain)."""
    layer = ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.inner_attention",
             "attention.wo", "ffn_norm", "feed_forward"]
    return ["tok_embeddings", *(f"layers.{i}.{m}" for i in range(titan.LAYERS) for m in layer), "norm", "output"]


@pytest.mark.parametrize("first", ["layers.0.attention.wk", "layers.0.attention.wv",
                                   "layers.0.attention.inner_attention", "layers.0.attention.wo"])
def test_titan_llama_cut_inside_attention_runs(first):
    # before wk, wv or attention, the rotated query crosses the cut transposed: sent as it lies in memory and
    # transposed back on arrival, attention's output has the model's layout again and the model's .view after
    # transpose(1, 2) works (sent contiguous, that view failed: "view size is not compatible with input tensor's
    # size and stride")
    titan = load_model_file("titan_llama", LAYERS=2)
    torch.manual_seed(0)
    model = titan.build_model()
    inputs, targets = titan.example_batch(2)
    chain = titan_chain(titan)
    cut = chain.index(first)
    _, output, expected = assert_stages_match_model(model, [chain[:cut], chain[cut:]], inputs, targets)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)


def test_a_transposed_activation_is_sent_as_it_lies_in_memory():
    titan = load_model_file("titan_llama", LAYERS=1)
    model = titan.build_model()
    chain = titan_chain(titan)
    cut = chain.index("layers.0.attention.inner_attention")
    split = split_model(model, titan.example_batch(2)[0], [chain[:cut], chain[cut:]])
    head_dim = titan.DIM // titan.HEADS
    # the query, key and value reach attention as (batch, heads, seq, head_dim) transposes of (batch, seq, heads,
    # head_dim) tensors: each crosses as the latter (no copy) and is transposed back on the next stage
    crossing = [meta[0] for meta in split.boundary_meta[1] if len(meta[0]) == 4]
    assert crossing == [(2, titan.SEQ_LEN, titan.HEADS, head_dim)] * 3


def test_hf_llama_with_its_default_kv_cache_is_cut():
    llama = load_model_file("plain_llama")
    torch.manual_seed(0)
    model = llama.build_model()
    assert model.config.use_cache  # a plain LlamaConfig: the forward returns a DynamicCache beside the logits
    inputs, targets = llama.example_batch(2)
    stages = [["model.embed_tokens", "model.layers.0", "model.layers.1"],
              ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    split, output, expected = assert_stages_match_model(model, stages, inputs, targets)
    torch.testing.assert_close(output.logits, expected.logits, rtol=0, atol=1e-6)
    assert output.past_key_values is None and len(split.boundary_meta[-1]) == 1  # the logits alone


def test_use_cache_in_the_batch_is_no_input_of_the_first_stage():
    llama = load_model_file("plain_llama")
    torch.manual_seed(0)
    inputs, targets = llama.example_batch(2)
    inputs = {**inputs, "use_cache": True}
    split, output, expected = assert_stages_match_model(
        llama.build_model(), [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.layers.2",
                                                                         "model.layers.3", "model.norm", "lm_head"]],
        inputs, targets)
    assert [meta[0] for meta in split.boundary_meta[0]] == [tuple(inputs["input_ids"].shape)]
    torch.testing.assert_close(output.logits, expected.logits, rtol=0, atol=1e-6)


class ReturnsACache(nn.Module):
    """Not a Hugging Face model, but it returns a Hugging Face KV cache beside its prediction, and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))), DynamicCache(), 3


def test_a_kv_cache_in_the_output_is_dropped_and_constants_kept():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    split, output, expected = assert_stages_match_model(ReturnsACache(), [["a"], ["b"]], x, y)
    assert isinstance(expected[1], DynamicCache) and output[1] is None and output[2] == 3
    torch.testing.assert_close(output[0], expected[0], rtol=0, atol=1e-6)


class Combine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, wide, gapped, turned):
        return self.linear(wide * gapped + turned.t()) + wide.sum(0)


class Broadcasts(nn.Module):
    """Values crossing the cut into `b`: an expanded tensor (stride 0), a slice with gaps, a transpose."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 12), Combine()

    def forward(self, x):
        h = self.a(x)  # (6, 12)
        wide = h[:, :4].unsqueeze(0).expand(3, 6, 4)  # broadcast over a new first dimension
        gapped = h[:, 4:8]  # every row skips 8 of its 12 values
        turned = h[:, 8:].t()  # (4, 6)
        return self.b(wide, gapped, turned)


def test_expanded_and_gapped_tensors_cross_a_cut():
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(3, 6, 4)
    split, output, expected = assert_stages_match_model(Broadcasts(), [["a"], ["b"]], x, y)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)
    # the expanded tensor crosses once, not three times; the transposed one as it lies in memory
    assert [meta[0] for meta in split.boundary_meta[1]] == [(6, 4, 1), (6, 4), (6, 4)]


def stride_order(tensor: torch.Tensor) -> list[int]:
    return sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))


@pytest.mark.parametrize("make, wire", [
    (lambda: torch.randn(2, 3, 4), (2, 3, 4)),
    (lambda: torch.randn(2, 4, 3).transpose(1, 2), (2, 4, 3)),
    (lambda: torch.randn(5, 1).expand(5, 7), (5, 1)),
    (lambda: torch.randn(4, 6)[:, 1:3].t(), (4, 2)),
], ids=["contiguous", "transposed", "expanded", "gapped"])
def test_send_layout_round_trip_keeps_values_and_the_order_of_strides(make, wire):
    value = make()
    layout = SendLayout.of(value)
    assert layout.wire_shape == wire
    graph = torch.fx.Graph()
    sent = layout.send(graph, graph.placeholder("x"))
    graph.output((sent, layout.receive(graph, sent)))
    on_wire, arrived = torch.fx.GraphModule(nn.Module(), graph)(value)
    assert on_wire.is_contiguous() and tuple(on_wire.shape) == wire
    torch.testing.assert_close(arrived, value, rtol=0, atol=0)
    assert stride_order(arrived) == stride_order(value)
    assert [s == 0 for s in arrived.stride()] == [s == 0 for s in value.stride()]
