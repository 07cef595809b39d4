"""A small ResNet for small images (32x32 CIFAR, 28x28 digits), trained from scratch in minutes on a CPU.

The ResNet of He et al. (2016, section 4.2) for CIFAR: a 3x3 stem, stages of basic residual blocks that halve
the resolution and double the width, global average pooling and a linear classifier. With the defaults
(widths 16/32/64, 3 blocks per stage) it is ResNet-20: 0.27M parameters. For larger images (96x96, say) a
patchify stem (`stem_stride=4`: a 4x4 convolution with stride 4) makes the first stage 16x cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a shortcut; where the shape changes, the shortcut average-pools then
    projects with a stride-1 1x1 conv (the "ResNet-D" shortcut of He et al. 2019, Bag of Tricks). Besides
    keeping the information a strided 1x1 conv drops, this avoids oneDNN's strided-1x1 NHWC backward,
    which corrupts memory on CPU with --channels_last when channels < its block (oneDNN issue #6035)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            pool = nn.AvgPool2d(stride, ceil_mode=True) if stride > 1 else nn.Identity()
            self.shortcut = nn.Sequential(pool, nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet for small images. `forward(pixel_values)` returns logits [B, num_labels], so a recipe calls it
    like a transformers image classifier (whose output has `.logits`); with `num_labels=0` it returns the
    pooled features [B, num_features] instead (a backbone, as timm's `num_classes=0`). `factory_kwargs` holds its
    constructor arguments: how the run directory says to rebuild it."""

    def __init__(self, num_labels: int, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 3,
                 in_channels: int = 3, stem_stride: int = 1):
        super().__init__()
        # how to build it again (model_factory.json, accel-train export): its own constructor arguments
        self.factory_kwargs = {"num_labels": num_labels, "widths": list(widths), "blocks_per_stage": blocks_per_stage,
                               "in_channels": in_channels, "stem_stride": stem_stride}
        # stride 1: a 3x3 conv at full resolution; stride s > 1: non-overlapping s x s patches (ConvNeXt's stem)
        kernel, padding = (3, 1) if stem_stride == 1 else (stem_stride, 0)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], kernel, stem_stride, padding, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for stage, width in enumerate(widths):
            for b in range(blocks_per_stage):
                blocks.append(BasicBlock(cin, width, stride=2 if stage > 0 and b == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.num_features = cin
        self.head = nn.Linear(cin, num_labels) if num_labels else nn.Identity()
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for block in self.blocks:  # each residual branch starts as identity: trains faster and deeper
            nn.init.zeros_(block.bn2.weight)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Globally average-pooled features [B, num_features]."""
        return self.blocks(self.stem(pixel_values)).mean(dim=(2, 3))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(pixel_values))


# How a run's model_factory.json names this class (the deploy layer writes it; the image-text towers read it).
SMALL_RESNET_FACTORY = f"{SmallResNet.__module__}:{SmallResNet.__qualname__}"
