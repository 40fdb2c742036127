"""A small convolutional net: trains in seconds on the XLA CPU device."""

from __future__ import annotations

import torch.nn as nn

from tpustream.errors import ConfigError
from tpustream.models.registry import register_model

# GroupNorm normalises each sample on its own: the network then computes the
# same function whatever the batch is cut into (micro-batches, replicas),
# which BatchNorm does not.
NORMS = {
    "batch": nn.BatchNorm2d,
    "group": lambda channels: nn.GroupNorm(max(1, channels // 4), channels),
}


def _conv_norm_relu(cin: int, cout: int, norm: str) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), NORMS[norm](cout), nn.ReLU(inplace=True)
    )


@register_model("small_cnn")
def small_cnn(
    *, num_classes: int, image_size: int, channels: int, width: int = 16, norm: str = "batch"
) -> nn.Module:
    """Three conv-norm-ReLU stages (width, 2x, 4x channels), global pooling, linear head.

    XLA:CPU runs convolutions 5-20x slower than eager PyTorch, so the CPU demo
    and tests use this instead of a ResNet. norm: batch or group.
    """
    del image_size  # global pooling makes the head independent of the input size
    if norm not in NORMS:
        raise ConfigError(f"model small_cnn: model.options.norm={norm!r} is not one of {', '.join(NORMS)}")
    if not isinstance(width, int) or width < 1:
        raise ConfigError(f"model small_cnn: model.options.width must be a whole number >= 1, got {width!r}")
    return nn.Sequential(
        _conv_norm_relu(channels, width, norm),
        nn.MaxPool2d(2),
        _conv_norm_relu(width, 2 * width, norm),
        nn.MaxPool2d(2),
        _conv_norm_relu(2 * width, 4 * width, norm),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )
