"""A plain MLP regressor: the smallest model autoplan plans.

    autoplan examples/mlp.py --gpus 2 --gpu cpu
"""

import torch
from torch import nn

IN_FEATURES = 64
HIDDEN = 256
LAYERS = 6
OUT_FEATURES = 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(LAYERS)
        )
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def build_model() -> nn.Module:
    return MLP()


def example_batch(batch_size: int):
    x = torch.randn(batch_size, IN_FEATURES)
    y = torch.randn(batch_size, OUT_FEATURES)
    return x, y
