"""Image classification on random 32x32 images.

The zoo of benchmarks/model_zoo.py: transformers families built from configs at tiny shapes
(no download, no weights), one factory per family (`autoplan benchmarks/zoo/vision.py:NAME`),
dropout 0 in the configs. They follow the model contract; the default loss (cross-entropy on
`.logits`) applies.
"""

import torch
from transformers import (
    ConvNextConfig,
    ConvNextForImageClassification,
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
)

IMAGE_SIZE = 32
CLASSES = 10

FAMILIES = (
    "convnext",
    "resnet",
    "swin",
)
"""The factories of this file, in the zoo's order."""


def convnext():
    """ConvNeXt: depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    return ConvNextForImageClassification(
        ConvNextConfig(
            num_channels=3,
            num_stages=2,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            image_size=IMAGE_SIZE,
            drop_path_rate=0.0,
            num_labels=CLASSES,
        )
    )


def resnet():
    """ResNet (transformers' own, no torchvision): basic blocks with BatchNorm."""
    return ResNetForImageClassification(
        ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=CLASSES,
        )
    )


def swin():
    """Swin: shifted-window attention over patches, patch merging between stages."""
    return SwinForImageClassification(
        SwinConfig(
            image_size=IMAGE_SIZE,
            patch_size=4,
            num_channels=3,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 4],
            window_size=4,
            drop_path_rate=0.0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=CLASSES,
        )
    )


build_model = convnext
"""The contract's default factory: this file's first family."""


def example_batch(batch_size: int):
    images = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    return ({"pixel_values": images}, torch.randint(0, CLASSES, (batch_size,)))
