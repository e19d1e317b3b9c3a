"""A model that trains on one device but fails inside the second pipeline stage of a distributed run:
its last block calls a custom op whose kernel raises when RANK is set (a torchrun rank), after
torch.export traced it through its fake kernel. For `autoplan verify`'s root-cause line."""

import os

import torch
from torch import nn

DIM = 16
MESSAGE = "rank-only failure: values out of range in the last block"


@torch.library.custom_op("autoplan_test::rank_check", mutates_args=())
def rank_check(x: torch.Tensor) -> torch.Tensor:
    if os.environ.get("RANK") is not None:
        raise ValueError(MESSAGE)
    return x.clone()


@rank_check.register_fake
def _(x):
    return torch.empty_like(x)


rank_check.register_autograd(lambda ctx, grad: grad)


class Checked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return rank_check(self.fc(x))


class FailingStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.last = Checked()

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def build_model():
    return FailingStage()


def example_batch(batch_size):
    return torch.randn(batch_size, DIM), torch.randn(batch_size, DIM)


def loss_fn(output, targets):
    return nn.functional.mse_loss(output, targets)
