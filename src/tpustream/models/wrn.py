"""wrn_seed: the 103M-parameter wide ResNet of the epoch-time study tpustream was seeded from.

"seed" names that study, not a random seed: a Keras comparison of TPU and GPU
epoch times on CIFAR-100 over batch sizes 64 to 4,096, with validation,
augmentation, in-memory data and loader workers switched on and off
(bench.epoch_time reruns it; docs/benchmarks.md). The model is kept under
that name so the study's runs can be repeated with ``model=wrn_seed``.

The study built it in Keras and published only its summary: k=7, N=4, 7x7
convolutions, 1x1 convolutions between stages, average-pool downsampling,
100 classes, 103,465,028 parameters of which 103,452,484 trainable. This is
the one layout of that description whose counts come out exactly (the test
checks them layer by layer):

- Keras layers carry a bias by default, so every convolution here has one;
- a 1x1 convolution (3 -> 16k channels) lifts the input to stage 1's width,
  and one between stages doubles the width before a 2x2 average pool;
- N pre-activation blocks per stage, each BN-ReLU-conv7x7 twice plus the
  identity, so there are 2N batch norms per stage and none elsewhere:
  their moving means and variances are the 12,544 non-trainable parameters
  (2 x 8 x (112 + 224 + 448));
- global average pooling and one dense layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tpustream.errors import ConfigError
from tpustream.models.registry import register_model


class PreActBlock(nn.Module):
    """x + conv(relu(bn(conv(relu(bn(x)))))) at constant width and resolution."""

    def __init__(self, width: int, kernel_size: int):
        super().__init__()
        padding = kernel_size // 2
        self.bn1 = nn.BatchNorm2d(width)
        self.conv1 = nn.Conv2d(width, width, kernel_size, padding=padding)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(torch.relu(self.bn1(x)))
        out = self.conv2(torch.relu(self.bn2(out)))
        return x + out


class SeedWideResNet(nn.Module):
    """A 1x1 stem, three stages of pre-activation blocks (widths base x k x 1, 2, 4), a linear head."""

    def __init__(self, *, num_classes: int, channels: int, k: int, n: int, kernel_size: int, base_width: int):
        super().__init__()
        widths = [base_width * k * 2**stage for stage in range(3)]
        layers: list[nn.Module] = [nn.Conv2d(channels, widths[0], 1)]
        for stage, width in enumerate(widths):
            if stage:
                layers += [nn.Conv2d(widths[stage - 1], width, 1), nn.AvgPool2d(2)]
            layers += [PreActBlock(width, kernel_size) for _ in range(n)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The pre-activation blocks end on a residual sum: one ReLU before pooling.
        return self.head(torch.flatten(self.pool(torch.relu(self.features(x))), 1))


@register_model("wrn_seed")
def wrn_seed(
    *,
    num_classes: int,
    image_size: int,
    channels: int,
    k: int = 7,
    n: int = 4,
    kernel_size: int = 7,
    base_width: int = 16,
) -> nn.Module:
    """k widens (stage widths 16k, 32k, 64k), n blocks per stage; the defaults are the study's model.

    Smaller k/n/kernel_size give the same architecture at a size the XLA CPU
    device trains in seconds.
    """
    for name, value in (("k", k), ("n", n), ("kernel_size", kernel_size), ("base_width", base_width)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"model wrn_seed: model.options.{name} must be a whole number >= 1, got {value!r}"
            )
    if kernel_size % 2 == 0:
        raise ConfigError(
            f"model wrn_seed: model.options.kernel_size must be odd (same padding), got {kernel_size}"
        )
    if image_size % 4:
        raise ConfigError(
            f"model wrn_seed halves the image twice; image size {image_size} is not a multiple of 4"
        )
    return SeedWideResNet(
        num_classes=num_classes, channels=channels, k=k, n=n, kernel_size=kernel_size, base_width=base_width
    )
