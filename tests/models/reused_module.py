"""A block that calls one module twice around a sibling (Phi's resid_dropout, the Megatron GPT's
dropout): its attention and MLP halves must stay on one pipeline stage."""

import torch
from torch import nn

WIDTH = 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))
        self.resid = nn.LayerNorm(WIDTH)  # called after the attention and again after the MLP
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.Tanh(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.resid(self.attn(x))
        return x + self.resid(self.mlp(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.block = Block()
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def build_model():
    return Model()


def example_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randn(batch_size, 4)
