"""torchvision ResNets, with a CIFAR-style stem for small images."""

from __future__ import annotations

import torch.nn as nn

from tpustream.models.registry import register_model

# Below this input size the ImageNet stem (7x7 stride-2 conv + max-pool) would
# shrink a 32x32 image to 8x8 before the first block and cost ~10 points of
# CIFAR accuracy; the usual fix is a 3x3 stride-1 conv and no pool.
SMALL_IMAGE_MAX = 64

# torchvision is imported where a ResNet is built, not with this module: its
# import pulls in torch._dynamo, about 3 s that train.py's start and runs of
# other models need not pay.


def _adapt(model: nn.Module, image_size: int, channels: int, cifar_stem: bool | None) -> nn.Module:
    if cifar_stem is None:
        cifar_stem = image_size <= SMALL_IMAGE_MAX
    if cifar_stem:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


@register_model("resnet18")
def resnet18(
    *, num_classes: int, image_size: int, channels: int, cifar_stem: bool | None = None
) -> nn.Module:
    """cifar_stem: 3x3 stride-1 first conv and no max-pool; null = for images up to 64 px."""
    import torchvision

    return _adapt(torchvision.models.resnet18(num_classes=num_classes), image_size, channels, cifar_stem)


@register_model("resnet50")
def resnet50(
    *, num_classes: int, image_size: int, channels: int, cifar_stem: bool | None = None
) -> nn.Module:
    """cifar_stem: 3x3 stride-1 first conv and no max-pool; null = for images up to 64 px."""
    import torchvision

    return _adapt(torchvision.models.resnet50(num_classes=num_classes), image_size, channels, cifar_stem)
