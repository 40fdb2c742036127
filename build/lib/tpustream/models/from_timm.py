"""model=timm: any of timm's image classifiers, built by ``timm.create_model``.

``num_classes`` and ``in_chans`` come from the data; ``model.options`` go to
the model's constructor as timm passes them (``drop_path_rate``, and for
ViT-style models made for 224 px, ``img_size`` and ``patch_size``).
Pretrained weights are not loaded here: ``model.pretrained=true`` has timm
fetch them once per host before spawning (models.pretrained).
"""

from __future__ import annotations

import difflib

import torch.nn as nn

from tpustream.errors import ConfigError

# Keys of model.options that timm.create_model takes itself, not the model:
# pretrained weights must not come from the hub in every replica (eight
# downloads racing into one cache); model.pretrained fetches them once per host.
REFUSED_OPTIONS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path")


def check_timm_name(name: str, options: dict) -> None:
    """ConfigError naming close matches if timm has no model `name`; refused options named."""
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; close: {', '.join(close)}" if close else "; timm.list_models() lists them"
        raise ConfigError(f"model=timm model.name={name!r} is not a timm model{hint}")
    refused = [key for key in REFUSED_OPTIONS if key in options]
    if refused:
        raise ConfigError(
            f"model.options.{refused[0]} for timm: each replica builds its timm model without downloading "
            "weights; set model.pretrained=true (timm's weights for model.name, which may carry a tag, "
            "fetched once per host) or model.pretrained=PATH to a file of weights"
        )


def create_timm_model(name: str, *, num_classes: int, image_size: int, channels: int, **options) -> nn.Module:
    """timm.create_model with the data's class and channel counts; image_size is for the caller's checks."""
    import timm

    del image_size  # timm models take img_size as an option where they need one
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=channels, **options)
