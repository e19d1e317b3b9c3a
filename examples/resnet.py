"""A small ResNet for image classification, built from torch.nn layers (no torchvision): a convolution
stem, stages of basic residual blocks (two 3x3 convolutions, each followed by BatchNorm), global
average pooling and a linear classifier.

BatchNorm normalizes each channel over the batch it sees in training, so autoplan plans it with
synchronized statistics under data parallelism and never splits a rank's batch into micro-batches.
Shapes are module-level constants a test can shrink.

    autoplan examples/resnet.py --gpus 2 --gpu cpu
"""

import torch
from torch import nn

IMAGE_SIZE = 32
IN_CHANNELS = 3
CLASSES = 10
WIDTHS = (16, 32, 64)
BLOCKS_PER_STAGE = 2


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (through a strided 1x1 conv-BN when the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(IN_CHANNELS, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, channels = [], widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return ResNet(WIDTHS, BLOCKS_PER_STAGE, CLASSES)


def example_batch(batch_size: int):
    images = torch.randn(batch_size, IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(0, CLASSES, (batch_size,))
    return images, labels
