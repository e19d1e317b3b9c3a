"""Selective recompute keeps the expert-parallel route's all-to-all outputs (runtime/distributed/recompute.py saved_ops, as
torchtitan's op-level save list keeps torch.ops._c10d_functional.all_to_all_single): the recomputation in backward
runs the route's permutations again but exchanges nothing, and the gradients are those of the unrecomputed route.
One process, a gloo group of one rank (the route's code path is the same; its exchanges copy)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.runtime.distributed.expert_parallel import ExpertShard, _route
from autoplan.runtime.distributed.recompute import _contexts


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.all_to_alls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "all_to_all" in func.__name__:
            self.all_to_alls += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _run(group, weight: torch.Tensor, hidden: torch.Tensor, mode: str | None) -> tuple[int, torch.Tensor]:
    """The route over 4 experts (each a scaled matmul) for 6 tokens, top-2: forward and backward, checkpointed with
    `mode`'s contexts (None: not checkpointed); returns the all-to-alls the backward ran and the weight's and tokens' gradients."""
    from torch.utils.checkpoint import checkpoint

    shard = ExpertShard(num_experts=4, degree=1, rank=0)
    index = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    scores = torch.linspace(0.1, 0.9, 12).reshape(6, 2)

    def experts(rows, local_expert, _ones):
        return torch.tanh(rows @ weight) * (1.0 + local_expert.to(rows.dtype))

    def layer(x):
        return _route(experts, shard, group, x, index, scores)

    weight.grad = hidden.grad = None
    out = checkpoint(layer, hidden, use_reentrant=False, context_fn=lambda: _contexts(mode == "selective")) \
        if mode else layer(hidden)
    counter = _CountCollectives()
    with counter:
        out.square().sum().backward()
    return counter.all_to_alls, torch.cat([weight.grad.flatten(), hidden.grad.flatten()])


def test_selective_recompute_exchanges_no_rows_again(one_rank):
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    hidden = torch.randn(6, 8, requires_grad=True)
    plain_exchanges, plain = _run(one_rank, weight, hidden, None)
    selective_exchanges, selective = _run(one_rank, weight, hidden, "selective")
    full_exchanges, full = _run(one_rank, weight, hidden, "full")
    # backward of the route: the rows' two all-to-alls retrace the route (dispatch and combine) in every mode
    assert plain_exchanges == 2
    # full recompute reruns the forward's four (counts, rows, ids, rows back); selective keeps their outputs
    assert full_exchanges == plain_exchanges + 4
    assert selective_exchanges == plain_exchanges
    torch.testing.assert_close(selective, plain, rtol=0, atol=0)
    torch.testing.assert_close(full, plain, rtol=0, atol=0)
