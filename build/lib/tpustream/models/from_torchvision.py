"""model=torchvision: torchvision's image classifiers, built by ``torchvision.models.get_model``."""

from __future__ import annotations

import difflib

import torch.nn as nn

from tpustream.errors import ConfigError


def classifier_names() -> list[str]:
    """torchvision's classification models (not its detection, segmentation or video ones)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_torchvision_name(name: str, options: dict) -> None:
    """ConfigError naming close matches if torchvision has no classifier `name`; weights refused."""
    names = classifier_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
        hint = f"; close: {', '.join(close)}" if close else f"; known: {', '.join(names[:8])}, ..."
        raise ConfigError(f"model=torchvision model.name={name!r} is not a torchvision classifier{hint}")
    if "weights" in options:
        raise ConfigError(
            "model.options.weights for torchvision: each replica builds its torchvision model without "
            "downloading weights; set model.pretrained=true (the DEFAULT weights, fetched once per host), "
            "a weights name (model.pretrained=IMAGENET1K_V2) or model.pretrained=PATH to a file of weights"
        )


def create_torchvision_model(
    name: str, *, num_classes: int, image_size: int, channels: int, **options
) -> nn.Module:
    """get_model with the data's class count; its classifiers take 3-channel images."""
    import torchvision

    del image_size  # checked by running the model on the meta device before spawning
    if channels != 3:
        raise ConfigError(
            f"model=torchvision {name} takes 3-channel images; these have {channels}: set data.channels=3"
        )
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **options)
