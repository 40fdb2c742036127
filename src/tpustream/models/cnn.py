"""A small convolutional net: trains in seconds on the XLA CPU device."""

from __future__ import annotations

import torch.nn as nn

from tpustream.models import register_model


def _conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


@register_model("small_cnn")
def small_cnn(*, num_classes: int, image_size: int, channels: int, width: int = 16) -> nn.Module:
    """Three conv-BN-ReLU stages (width, 2x, 4x channels), global pooling, linear head.

    XLA:CPU runs convolutions 5-20x slower than eager PyTorch, so the CPU demo
    and tests use this instead of a ResNet.
    """
    del image_size  # global pooling makes the head independent of the input size
    return nn.Sequential(
        _conv_bn_relu(channels, width),
        nn.MaxPool2d(2),
        _conv_bn_relu(width, 2 * width),
        nn.MaxPool2d(2),
        _conv_bn_relu(2 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )
