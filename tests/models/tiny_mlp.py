"""An MLP the planner has never seen: a Sequential trunk, dict-free, MSE loss by default."""

import torch
from torch import nn

WIDTH, DEPTH = 128, 6


def build_model():
    layers = [nn.Linear(32, WIDTH), nn.ReLU()]
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 4))
    return nn.Sequential(*layers)


def example_batch(batch_size):
    return torch.randn(batch_size, 32), torch.randn(batch_size, 4)
