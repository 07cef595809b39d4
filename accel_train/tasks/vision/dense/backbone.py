"""The project's SmallResNet as a dense backbone: its stem and stages, each stage's output kept.

Detection and segmentation heads need features at several resolutions, not the pooled vector a classifier
uses, so `ResNetStages` splits a `SmallResNet` (same blocks, same initialisation) into its stages and returns
every stage's output; stage i has stride ``stem_stride * 2**i`` and ``widths[i]`` channels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..models import SmallResNet


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    """3x3 convolution, batch norm, ReLU: the block the dense heads are built of."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class ResNetStages(nn.Module):
    """`forward(pixel_values) -> [stage 0 output, stage 1 output, ...]` of a SmallResNet."""

    def __init__(self, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 2, stem_stride: int = 1,
                 in_channels: int = 3):
        super().__init__()
        resnet = SmallResNet(0, widths, blocks_per_stage, in_channels, stem_stride)
        self.stem = resnet.stem
        blocks = list(resnet.blocks)
        self.stages = nn.ModuleList(nn.Sequential(*blocks[i * blocks_per_stage:(i + 1) * blocks_per_stage])
                                    for i in range(len(widths)))
        self.widths = list(widths)
        self.strides = [stem_stride * 2**i for i in range(len(widths))]

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(pixel_values)
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features
