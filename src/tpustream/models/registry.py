"""The model registry: families register a factory by name, configs name one, ``create_model`` builds it."""

from __future__ import annotations

import difflib
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


# Where model.name is looked up, besides the built-in families registered here.
LIBRARIES = ("tpustream", "timm", "torchvision")


def check_model_options(name: str, options: dict, library: str = "tpustream") -> None:
    """Fail before spawning if the name is unknown or a built-in family does not take the options.

    timm's and torchvision's constructors take **kwargs through several
    layers, so their options are checked by building the model
    (check_model_builds) instead of by signature.
    """
    if library == "timm":
        from tpustream.models.from_timm import check_timm_name

        check_timm_name(name, options)
        return
    if library == "torchvision":
        from tpustream.models.from_torchvision import check_torchvision_name

        check_torchvision_name(name, options)
        return
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, model_names(), n=3, cutoff=0.5)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise ConfigError(
            f"model.name={name!r} is not a known model{hint}; known: {', '.join(model_names())} "
            "(or model=timm / model=torchvision with their names)"
        )
    try:
        inspect.signature(_REGISTRY[name]).bind(num_classes=1, image_size=1, channels=1, **options)
    except TypeError as exc:
        raise ConfigError(f"model.options for {name}: {exc}") from None


def check_model_builds(
    name: str,
    options: dict,
    *,
    num_classes: int,
    input_size: tuple[int, int],
    channels: int,
    library: str = "tpustream",
    layer_groups: bool = False,
) -> None:
    """Build the model and run it on the meta device with the data's shapes, or ConfigError.

    Shapes only, no memory or arithmetic: free even for 100M parameters. The
    families check their option values; anything else a constructor or the
    forward pass raises (an option a timm model does not take, a ViT made for
    224 px fed 32 px) is one line here instead of a traceback in every replica.
    layer_groups: the model must also have timm's group_matcher (optim.layer_decay).
    """
    import torch

    height, width = input_size
    library = getattr(library, "value", library)  # config.ModelLibrary: its value in messages
    where = f"model={library} {name}" if library != "tpustream" else f"model={name}"
    try:
        with torch.device("meta"):
            model = create_model(
                name,
                num_classes=num_classes,
                image_size=max(height, width),
                channels=channels,
                library=library,
                **options,
            )
            out = model(torch.empty(2, channels, height, width))
    except ConfigError:
        raise
    except Exception as exc:  # the library's own error: name it with the options and shapes
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = (
            "; timm models made for another input size take model.options.img_size (and patch_size)"
            if library == "timm" and "img_size" not in options
            else ""
        )
        raise ConfigError(
            f"{where} with model.options {options} on {channels}x{height}x{width} images: "
            f"{exc.__class__.__name__}: {message}{hint}"
        ) from None
    if layer_groups and not hasattr(model, "group_matcher"):
        raise ConfigError(
            f"optim.layer_decay needs a model with layer groups (timm's group_matcher), and {where} has "
            "none: use model=timm with a ViT, DeiT, ConvNeXt, ... or optim.layer_decay=0"
        )
    if tuple(out.shape) != (2, num_classes):
        raise ConfigError(
            f"{where} gives outputs of shape {tuple(out.shape)[1:]} per image, not the {num_classes} class "
            "scores a classifier gives"
        )


def create_model(
    name: str, *, num_classes: int, image_size: int, channels: int, library: str = "tpustream", **options
) -> nn.Module:
    """The model `name` of `library` for this data (image_size: the larger side of its images)."""
    sizes = {"num_classes": num_classes, "image_size": image_size, "channels": channels}
    if library == "timm":
        from tpustream.models.from_timm import create_timm_model

        return create_timm_model(name, **sizes, **options)
    if library == "torchvision":
        from tpustream.models.from_torchvision import create_torchvision_model

        return create_torchvision_model(name, **sizes, **options)
    if name not in _REGISTRY:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    return _REGISTRY[name](**sizes, **options)
