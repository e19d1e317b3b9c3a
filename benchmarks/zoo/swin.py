"""Swin: shifted-window attention over patches, patch merging between stages.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import SwinConfig, SwinForImageClassification

IMAGE_SIZE = 32
CLASSES = 10


def config() -> SwinConfig:
    return SwinConfig(image_size=IMAGE_SIZE, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2,
                      4], window_size=4, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=CLASSES)


def build_model() -> SwinForImageClassification:
    return SwinForImageClassification(config())


def example_batch(batch_size: int):
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return {"pixel_values": images}, torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
