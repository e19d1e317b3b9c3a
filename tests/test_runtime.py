"""autoplan.runtime in one process: the pipeline split (stages chained = the model, forward and
backward), the data slicing, the default loss and gradient accumulation."""

import copy
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from autoplan.errors import UserError
from autoplan.layout import Parallelism
from autoplan.runtime import AccumulationStep, default_loss, microbatches, shard, split_model, step_batch
from autoplan.runtime.distributed.failures import NOTE_PREFIX, stage_failures

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT_STAGES = [("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f", "lm_head")]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"autoplan_test_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return load_example("gpt").GPT(vocab=64, seq_len=8, n_layer=4, n_head=2, n_embd=16)


class SkipTied(nn.Module):
    """Three chain modules; h0 and the input x skip stage 1; c is tied to a; `pos` reads nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(8, dtype=x.dtype)
        h0 = torch.tanh(self.a(x + pos))
        h1 = torch.tanh(self.b(h0))
        return self.c(h1) + h0 + x + pos


def run_stages(split, inputs) -> tuple:
    """The last stage's output (the flat model output) with the stages chained by hand."""
    values = split.flatten_inputs(inputs)
    for stage in split.stages:
        values = stage(*values)
    return values


def stage_grads(split) -> dict[str, torch.Tensor]:
    """Model FQN -> gradient summed over the stage copies that hold it."""
    grads: dict[str, torch.Tensor] = {}
    for stage, names in zip(split.stages, split.parameter_fqns):
        params = dict(stage.named_parameters())
        for name, fqn in names.items():
            grads[fqn] = grads.get(fqn, 0) + params[name].grad
    return grads


def assert_chain_matches_model(model: nn.Module, stages, inputs, targets, loss_fn=default_loss):
    reference = copy.deepcopy(model)  # the split shares the model's tensors: keep grads apart
    expected = reference(inputs)
    loss_fn(expected, targets).backward()
    split = split_model(model, inputs, stages)
    flat = run_stages(split, inputs)
    torch.testing.assert_close(split.unflatten_output(flat), expected, rtol=0, atol=1e-6)
    split.loss(loss_fn)(flat, targets).backward()
    grads = stage_grads(split)
    reference_params = dict(reference.named_parameters())
    assert set(grads) == set(reference_params)
    for fqn, grad in grads.items():
        torch.testing.assert_close(grad, reference_params[fqn].grad, rtol=1e-5, atol=1e-6, msg=fqn)
    return split


def test_gpt_split_in_two_matches_the_model_and_sums_tied_gradients():
    model = tiny_gpt()
    idx = torch.randint(0, 64, (2, 9))
    split = assert_chain_matches_model(model, GPT_STAGES, idx[:, :-1], idx[:, 1:])
    # lm_head.weight is wte.weight: one copy per stage, same initial value, listed as tied
    (tied,) = split.tied
    assert tied.fqn == "wte.weight" and tied.stages == (0, 1) and tied.names == ("wte.weight", "lm_head.weight")
    first, last = split.stages[0].get_parameter("wte.weight"), split.stages[1].get_parameter("lm_head.weight")
    assert first is model.wte.weight and last is not first and torch.equal(first, last)
    # every chain module is a submodule the stage calls (FSDP and checkpointing wrap these)
    assert split.chain_modules == [tuple(s) for s in GPT_STAGES]
    block = split.stages[1].get_submodule("blocks.2")
    assert isinstance(block, fx.GraphModule) and "attn.qkv.weight" in dict(block.named_parameters())
    calls = [n.target for n in split.stages[1].graph.nodes if n.op == "call_module"]
    assert calls == ["blocks.2", "blocks.3", "ln_f", "lm_head"]
    # the parameters keep the model's names
    names = dict(model.named_parameters(remove_duplicate=False))
    assert set(dict(split.stages[1].named_parameters())) == {
        n for n in names if n.startswith(("blocks.2.", "blocks.3.", "ln_f.", "lm_head."))}


def test_skip_values_thread_through_the_middle_stage():
    torch.manual_seed(0)
    model = SkipTied()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    split = assert_chain_matches_model(model, [("a",), ("b",), ("c",)], x, y)
    # stage 1 receives h0 and x although only stage 2 uses them, and hands them on
    shapes = [[meta[0] for meta in stage] for stage in split.boundary_meta]
    assert shapes == [[(4, 8)], [(4, 8), (4, 8)], [(4, 8), (4, 8), (4, 8)], [(4, 8)]]
    # x carries no gradient, h0 and h1 do (they are computed from parameters)
    assert [meta[2] for meta in split.boundary_meta[2]] == [False, True, True]
    # the arange is recomputed on both stages that use it, never sent
    aranges = [sum(n.target is torch.ops.aten.arange.default for n in s.graph.nodes) for s in split.stages]
    assert aranges == [1, 0, 1]
    (tied,) = split.tied
    assert tied.stages == (0, 2)


def test_a_module_called_twice_stays_inline():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.f(self.g(self.f(x)))

    torch.manual_seed(0)
    split = assert_chain_matches_model(Twice(), [("f", "g")], torch.randn(2, 4), torch.randn(2, 4))
    assert split.chain_modules == [("g",)]  # f runs before and after g: it cannot be one call


def test_a_view_crossing_a_stage_boundary_is_sent_contiguous_as_it_lies_in_memory():
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 6), nn.Linear(4, 3)

        def forward(self, x):
            return self.b(self.a(x).transpose(0, 1))  # the transpose is glue: it runs on a's stage

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(6, 3)
    split = assert_chain_matches_model(Transposed(), [("a",), ("b",)], x, y)
    (sent,) = split.stages[0](*split.flatten_inputs(x))
    assert sent.is_contiguous()  # isend rejects views
    # the (6, 4) transpose is sent as the (4, 6) tensor it views (no copy), transposed back by stage 1
    assert [meta[0] for meta in split.boundary_meta[1]] == [tuple(sent.shape)] == [(4, 6)]


def test_dict_inputs_and_dict_outputs_round_trip():
    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x, bias):
            return {"logits": self.head(self.enc(x)) + bias}

    torch.manual_seed(0)
    model = DictModel()
    inputs = {"x": torch.randn(2, 4), "bias": torch.randn(2, 3)}
    targets = torch.tensor([0, 2])
    expected = default_loss(model(**inputs), targets)
    split = split_model(model, inputs, [("enc",), ("head",)])
    torch.testing.assert_close(split.loss(None)(run_stages(split, inputs), targets), expected)


class MaskedLinear(nn.Linear):
    """Writes its input in place through a view before the matmul (DeBERTa's masked_fill_ of a score)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.t().masked_fill_(torch.eye(8, x.shape[0], dtype=torch.bool), 0.0)
        return super().forward(x)


class WritesInPlace(nn.Module):
    """Stage b writes the activation it receives in place, and c reads the written value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), MaskedLinear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h)


def test_a_stage_that_writes_its_received_activation_in_place_writes_a_clone():
    # the pipeline hands a stage its inputs as leaves that require grad: autograd refuses to write one in place
    torch.manual_seed(0)
    model, x = WritesInPlace(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.sum().backward()
    split = split_model(model, x, [("a",), ("b", "c")])
    (received,) = (v.detach().requires_grad_() for v in split.stages[0](*split.flatten_inputs(x)))
    (output,) = split.stages[1](received)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)
    output.sum().backward()
    (boundary,) = split.stages[0](*split.flatten_inputs(x))
    boundary.backward(received.grad)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, param.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stages, message", [
    ([("blocks.2", "blocks.3", "ln_f", "lm_head"), ("wte", "wpe", "blocks.0", "blocks.1")], "not in the order"),
    ([("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f", "lm_head", "no_such")], "run no op"),
    ([("wte", "wpe", "blocks", "blocks.0"), ("ln_f", "lm_head")], "must not nest"),
])
def test_split_rejects_plans_that_do_not_fit_the_model(stages, message):
    idx = torch.randint(0, 64, (2, 8))
    with pytest.raises(UserError, match=message):
        split_model(tiny_gpt(), idx, stages)


def test_step_batch_is_deterministic_and_shards_are_contiguous():
    def example_batch(n):
        return {"x": torch.randn(n, 3), "m": torch.ones(n, 2)}, torch.randn(n, 1)

    first = step_batch(example_batch, 8, seed=5, step=1)
    again = step_batch(example_batch, 8, seed=5, step=1)
    other = step_batch(example_batch, 8, seed=5, step=2)
    assert torch.equal(first[0]["x"], again[0]["x"]) and not torch.equal(first[0]["x"], other[0]["x"])
    inputs, targets = shard(first, 1, 2)
    assert torch.equal(inputs["x"], first[0]["x"][4:]) and torch.equal(targets, first[1][4:])
    parts = microbatches(first, 4)
    assert torch.equal(torch.cat([inputs["x"] for inputs, _ in parts]), first[0]["x"])
    with pytest.raises(UserError, match="returned 3 samples"):
        step_batch(lambda n: (torch.zeros(3, 1), torch.zeros(3)), 8, seed=0, step=0)


def test_default_loss():
    logits, tokens = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits.reshape(-1, 7), tokens.reshape(-1))
    torch.testing.assert_close(default_loss(logits, tokens), expected)
    torch.testing.assert_close(default_loss(SimpleNamespace(logits=logits), tokens), expected)
    torch.testing.assert_close(default_loss({"logits": logits}, tokens), expected)
    prediction, target = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(default_loss(prediction, target), F.mse_loss(prediction, target))


def test_gradient_accumulation_equals_the_whole_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    default_loss(reference(x), y).backward()
    loss = AccumulationStep(model, Parallelism(microbatches=3), loss_fn=None)(x, y)
    torch.testing.assert_close(loss, default_loss(reference(x), y).detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_an_error_inside_a_stage_is_noted_with_its_op_module_stage_and_source_line():
    torch.manual_seed(0)
    model = WritesInPlace()
    split = split_model(model, torch.randn(4, 8), [("a",), ("b", "c")])
    with pytest.raises(RuntimeError) as raised, stage_failures({1: split.stages[1]}):
        try:
            split.stages[1](torch.randn(4, 5))  # the wrong width: b's matmul fails
        except RuntimeError as error:  # as torch's pipeline stage does around a failing forward
            raise RuntimeError("[Stage 1] failed to run forward") from error
    (note,) = raised.value.__cause__.__notes__
    assert note.startswith(f"{NOTE_PREFIX}aten.") and " in b (MaskedLinear), pipeline stage 1, from " in note
    assert re.search(r"test_runtime\.py:\d+ in forward$", note), note
    # an exception from outside the stages' code gets no note
    with pytest.raises(ValueError) as plain, stage_failures({1: split.stages[1]}):
        raise ValueError("not a stage")
    assert not getattr(plain.value, "__notes__", None)
