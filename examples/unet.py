"""A U-Net for image segmentation, written from scratch: convolutions, group norms, and long skip
connections that carry each encoder level's features across to the decoder level of the same size.

Defaults: 4 levels of 64..512 channels on 256x256 RGB images, 21 classes (~31M parameters). Shapes are
module-level constants a test can shrink.

    autoplan examples/unet.py --gpus 8
"""

import torch
from torch import nn
from torch.nn import functional as F

IMAGE_SIZE = 256
IN_CHANNELS = 3
CLASSES = 21
BASE_WIDTH = 64
DEPTH = 4
GROUPS = 8


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by a group norm and SiLU."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class Up(nn.Module):
    """Upsample by a transposed convolution, concatenate the skip connection, then a DoubleConv."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(channels_in, channels_out, 2, stride=2)
        self.conv = DoubleConv(2 * channels_out, channels_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels: int, classes: int, base_width: int, depth: int) -> None:
        super().__init__()
        widths = [base_width * 2**level for level in range(depth + 1)]
        self.stem = DoubleConv(in_channels, widths[0])
        self.down = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        skips = []
        for block in self.down:
            skips.append(x)
            x = block(F.max_pool2d(x, 2))
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


def build_model() -> nn.Module:
    return UNet(IN_CHANNELS, CLASSES, BASE_WIDTH, DEPTH)


def example_batch(batch_size: int):
    images = torch.randn(batch_size, IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)
    masks = torch.randint(0, CLASSES, (batch_size, IMAGE_SIZE, IMAGE_SIZE))
    return images, masks


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)
