"""The zero-bubble schedules' split backward (runtime/distributed/split_backward.py), on one process: a stage's input- and
weight-gradient passes together give every weight the gradient of a full backward, also along a path from an
output that no input requiring gradient reaches (an embedding reading token ids beside a layer reading the received
activation: BART's stage with the encoder's last layer and the decoder's embed_tokens)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from autoplan.runtime.distributed.split_backward import UNREACHED, unreached_outputs, weight_gradients_from


class TwoPathStage(nn.Module):
    """Output 1 from token ids only (`embed`: none of its paths meets the received activation); outputs 0 and 2 both
    from `mix` over `positions`, 0 also from the activation (`mix` has a path of each kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.embed = nn.Embedding(16, 8)
        self.positions = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = self.positions(ids)
        return self.layer(hidden) + self.mix(positions), self.embed(ids) * 2.0, self.mix(positions).tanh()


def _split(stage: TwoPathStage) -> dict[str, torch.Tensor | None]:
    """Input pass, then weight pass as torch's schedules run them with autoplan's part first (SplitBackwardStage)."""
    torch.manual_seed(1)
    hidden = torch.randn(3, 8, requires_grad=True)
    ids = torch.randint(0, 16, (3,))
    grads = [torch.randn(3, 8) for _ in range(3)]
    outputs = list(stage(hidden, ids))
    unreached = unreached_outputs(outputs, grads, [hidden, ids])
    _, groups = stage_backward_input(outputs, grads, [hidden, ids], stage.parameters())
    weight_gradients_from(unreached, list(stage.parameters()))
    stage_backward_weight(stage.parameters(), [g for g in groups if UNREACHED not in g])
    return {name: p.grad for name, p in stage.named_parameters()}


def _full(stage: TwoPathStage) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    hidden = torch.randn(3, 8, requires_grad=True)
    ids = torch.randint(0, 16, (3,))
    grads = [torch.randn(3, 8) for _ in range(3)]
    torch.autograd.backward(list(stage(hidden, ids)), grads)
    return {name: p.grad for name, p in stage.named_parameters()}


def _stages() -> tuple[TwoPathStage, TwoPathStage]:
    torch.manual_seed(0)
    first = TwoPathStage()
    second = TwoPathStage()
    second.load_state_dict(first.state_dict())
    return first, second


def test_outputs_no_received_input_reaches_are_the_ones_reading_only_token_ids():
    stage = TwoPathStage()
    hidden = torch.randn(3, 8, requires_grad=True)
    outputs = list(stage(hidden, torch.randint(0, 16, (3,))))
    unreached = unreached_outputs(outputs, [torch.ones(3, 8)] * 3, [hidden])
    assert [edge.node for edge, _ in unreached] == [outputs[1].grad_fn, outputs[2].grad_fn]


def test_the_split_backward_gives_every_weight_its_full_backward_gradient():
    split, full = _stages()
    got, expected = _split(split), _full(full)
    for name, grad in expected.items():
        assert got[name] is not None and torch.allclose(got[name], grad, atol=1e-6), name



def test_gradient_buckets_keep_the_order_and_hold_one_dtype_up_to_the_size():
    from autoplan.runtime.distributed.split_backward import buckets

    grads = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(10), torch.zeros(1)]
    cut = buckets(grads, bucket_bytes=32)  # 8 fp32 values
    assert [[g.numel() for g in bucket] for bucket in cut] == [[4, 4], [2], [10], [1]]
    assert [g for bucket in cut for g in bucket] == grads


def test_the_replicas_mean_leaves_a_parameter_no_member_reached_without_a_gradient(tmp_path):
    """One member: the mean is the gradient itself; a parameter without a gradient on every member keeps none (as the
    single-device model leaves it), one frozen is left alone."""
    import torch.distributed as dist

    from autoplan.runtime.distributed.split_backward import all_reduce_mean

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        used, unused, frozen = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        frozen.requires_grad_(False)
        used.grad = torch.arange(3.0)
        all_reduce_mean([used, unused, frozen], dist.group.WORLD)
        assert torch.equal(used.grad, torch.arange(3.0)) and unused.grad is None and frozen.grad is None
    finally:
        dist.destroy_process_group()
