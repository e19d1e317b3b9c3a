"""A forward that branches on its tensors' device type, as transformers' MoE does (a float histogram on
CPU): a pipeline stage must record the branch of the device it runs on, not the meta device's."""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h * (2.0 if h.device.type == "cpu" else 3.0))


def build_model():
    return Model()


def example_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
