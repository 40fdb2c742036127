"""The run's model as its data shapes it: one rule for every place that builds it before or in a replica.

The replica builds it for training, data.num_workers=auto counts its FLOPs,
and the checks before spawning (model.pretrained, a checkpoint's shapes) build
it on the meta device; all of them must agree on classes, image size and
channels, which come from the training split, not from model.options.
"""

from __future__ import annotations

import functools
from typing import Any

from tpustream.config import TrainConfig
from tpustream.data.format.manifest import ShardManifest


def model_builder(cfg: TrainConfig, train: ShardManifest) -> functools.partial:
    """create_model for this run's model and the training split's classes, size and channels."""
    # Imported here: the launcher's checks import this module before anything needs torch.
    from tpustream.models import create_model

    height, width = train.image_size
    return functools.partial(
        create_model,
        cfg.model.name,
        num_classes=train.num_classes,
        image_size=max(height, width),
        channels=train.channels,
        library=cfg.model.library,
        **cfg.model.options,
    )


def meta_model(cfg: TrainConfig, train: ShardManifest) -> Any:
    """The run's model on the meta device: its shapes, without memory or init arithmetic (wrn_seed's
    103M parameters cost nothing), for the checks before spawning."""
    import torch

    with torch.device("meta"):
        return model_builder(cfg, train)()
