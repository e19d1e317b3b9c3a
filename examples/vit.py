"""Vision Transformer image classifier (Hugging Face transformers), built from a config.

Defaults are ViT-B/16 at 224x224 on ImageNet-1k (86M parameters). Inputs are float images, targets
class ids. Shapes are module-level constants a test can shrink; build_model(**overrides) passes
ViTConfig overrides.

    autoplan examples/vit.py --gpus 8
"""

import torch
from torch.nn import functional as F
from transformers import ViTConfig, ViTForImageClassification

IMAGE_SIZE = 224
PATCH_SIZE = 16
CHANNELS = 3
HIDDEN = 768
INTERMEDIATE = 3072
LAYERS = 12
HEADS = 12
CLASSES = 1000


def config(**overrides) -> ViTConfig:
    settings = dict(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=CHANNELS, hidden_size=HIDDEN,
                    intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_labels=CLASSES)
    settings.update(overrides)
    return ViTConfig(**settings)


def build_model(**overrides) -> ViTForImageClassification:
    return ViTForImageClassification(config(**overrides))


def example_batch(batch_size: int):
    images = torch.randn(batch_size, CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(0, CLASSES, (batch_size,))
    return {"pixel_values": images}, labels


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
