"""Activation checkpointing of compiled chain modules (the plan's recompute=selective|full with compile=on):
torch.compile accepts the checkpoint's contexts, the first step's gradients equal the model's without either,
dropout is off inside the compiled checkpoint while runtime/distributed/dropout.py NoDropout is active (autoplan verify) and on
without it, and nothing falls back to eager at a graph break. AOTAutograd (where torch.compile handles the
checkpoint) with the aot_eager backend: inductor's C++ build of the same graphs runs in the slow parity
matrix (tests/test_pairs_matrix.py)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autoplan.runtime import checkpoint_modules, compile_modules
from autoplan.runtime.distributed.dropout import NoDropout

COMPILE = nn.Module.compile


class Block(nn.Module):
    """A matmul (saved by "selective"), a pointwise op (recomputed) and dropout three ways."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(torch.tanh(self.drop(self.fc(x))), 0.3, self.training)
        q = y.view(2, 2, 4, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0).reshape(4, 8) + x


@pytest.fixture
def aot_eager(monkeypatch):
    """compile_modules' nn.Module.compile through AOTAutograd without inductor's C++ build; counts graph breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: COMPILE(self, backend="aot_eager", **kwargs))
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def first_gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = next(p for name, p in model.named_parameters() if name.endswith("fc.weight"))
    return torch.autograd.grad(model(x).square().sum(), weight)[0]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_compiled_modules_train_like_the_plain_model_with_dropout_off(aot_eager, mode):
    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()), torch.randn(4, 8)
    model.eval()  # every dropout off: the reference
    reference = first_gradient(model, x)
    model.train()
    chain = ["0", "1"]
    wrapped = compile_modules(checkpoint_modules(model, chain, mode), chain, True)
    with NoDropout():
        gradient = first_gradient(wrapped, x)
    torch.testing.assert_close(gradient, reference)
    assert not aot_eager["graph_break"], dict(aot_eager["graph_break"])  # each module compiled whole
    assert aot_eager["stats"]["unique_graphs"] >= 1
    assert not torch.allclose(first_gradient(wrapped, x), reference)  # without NoDropout, training drops out


class Annotated(nn.Module):
    """A block whose recomputation opens one more profiler annotation than its forward, as FSDP2's post-forward hook
    does for an experts module that is its own FSDP2 unit inside a selectively checkpointed block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for _ in range(self.calls):
            with torch.profiler.record_function("annotation"):
                pass
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_annotations_do_not_count_in_the_selective_replay(mode):
    """An extra annotation in the recomputation is not an op the checkpoint replays: eager selective checkpointing
    used to fail ("invocation index 1 ... not found in storage"); the gradients equal the plain module's."""
    torch.manual_seed(0)
    plain = nn.Sequential(Annotated())
    wrapped = checkpoint_modules(nn.Sequential(Annotated()), ["0"], mode)
    wrapped.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(4, 8)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    for (name, ours), theirs in zip(wrapped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_checkpoint_traced_outside_dynamo_gets_dispatch_modes(mode):
    """AOTAutograd traces a compiled checkpoint's higher-order op after dynamo is done (inductor's lowering), where
    torch.compiler.is_compiling() can be false (torch 2.11) while torch.utils.checkpoint, seeing the proxy mode,
    demands a pair of TorchDispatchModes. make_fx alone is that situation: the contexts must be the modes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    model = checkpoint_modules(nn.Sequential(Block(), Block()), ["0", "1"], mode).eval()
    x = torch.randn(4, 8)

    def step(x):
        return model(x).sum()

    # torch's selective checkpoint writes its tags into fx's node meta of the running trace: make_fx outside
    # compile's own preserve_node_meta would leave them behind for the next compilation in this process
    with torch.fx.traceback.preserve_node_meta():
        graph = make_fx(step)(x)
    assert torch.allclose(graph(x), step(x))


def test_more_kinds_of_recomputed_modules_than_dynamos_recompile_limit_all_compile(aot_eager):
    """Every checkpoint-wrapped chain module shares checkpoint_wrapper's forward, so each kind of module is one more
    graph of that code object; past dynamo's recompile limit (8) the rest would run eager. Twelve kinds, all
    compiled: twelve graphs, none left to eager."""
    import torch._dynamo.config

    kinds = [type(f"Kind{i}", (nn.Linear,), {}) for i in range(12)]
    model = nn.Sequential(*(kind(8, 8) for kind in kinds))
    chain = [str(i) for i in range(len(kinds))]
    limit = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8
        wrapped = compile_modules(checkpoint_modules(model, chain, "full"), chain, True)
        wrapped(torch.randn(4, 8)).sum().backward()
    finally:
        torch._dynamo.config.recompile_limit = limit
    assert aot_eager["stats"]["unique_graphs"] == len(kinds)
