"""ResNet (transformers' own, no torchvision): basic blocks with BatchNorm.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import ResNetConfig, ResNetForImageClassification

IMAGE_SIZE = 32
CLASSES = 10


def config() -> ResNetConfig:
    return ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                        num_labels=CLASSES)


def build_model() -> ResNetForImageClassification:
    return ResNetForImageClassification(config())


def example_batch(batch_size: int):
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return {"pixel_values": images}, torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
