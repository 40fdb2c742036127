"""Models: the registry (``registry``) and one module per family, registered when imported here."""

from __future__ import annotations

from tpustream.models import cnn, resnet, wrn  # noqa: F401  (importing a family registers it)
from tpustream.models.registry import (
    check_model_builds,
    check_model_config,
    check_model_options,
    create_model,
    model_names,
    register_model,
)

__all__ = [
    "check_model_builds",
    "check_model_config",
    "check_model_options",
    "create_model",
    "model_names",
    "register_model",
]
