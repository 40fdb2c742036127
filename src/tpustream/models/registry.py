"""The model registry: families register a factory by name, configs name one, ``create_model`` builds it."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.nn as nn

from tpustream.errors import ConfigError

ModelFactory = Callable[..., nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator: make a factory ``f(num_classes, image_size, channels, **options)`` findable by name."""

    def wrap(factory: ModelFactory) -> ModelFactory:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def check_model_options(name: str, options: dict) -> None:
    """Fail before spawning if a family does not take the configured options."""
    if name not in _REGISTRY:
        raise ConfigError(f"model.name={name!r} is not a known model; known: {', '.join(model_names())}")
    try:
        inspect.signature(_REGISTRY[name]).bind(num_classes=1, image_size=1, channels=1, **options)
    except TypeError as exc:
        raise ConfigError(f"model.options for {name}: {exc}") from None


def check_model_builds(name: str, *, num_classes: int, image_size: int, channels: int, **options) -> None:
    """Build the model on the meta device (shapes only: free even for 100M parameters), or ConfigError.

    The families check their option values; anything else a constructor
    raises with these options is one line here instead of a traceback in
    every replica.
    """
    import torch

    try:
        with torch.device("meta"):
            create_model(name, num_classes=num_classes, image_size=image_size, channels=channels, **options)
    except ConfigError:
        raise
    except Exception as exc:  # a constructor's own error: name it with the options that caused it
        raise ConfigError(
            f"model={name} with model.options {options}: {exc.__class__.__name__}: {exc}"
        ) from None


def create_model(name: str, *, num_classes: int, image_size: int, channels: int, **options) -> nn.Module:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return _REGISTRY[name](num_classes=num_classes, image_size=image_size, channels=channels, **options)
