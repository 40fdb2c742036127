"""The model registry: families register a factory by name, configs name one, ``create_model`` builds it."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

import torch.nn as nn

from tpustream.config import ModelConfig, ModelLibrary
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

# The constructor arguments tpustream passes itself, from the data, per library,
# and the data.* key that sets each. The same name in model.options would be
# given twice ("got multiple values for keyword argument"), an internal
# message that does not say where the value comes from.
RESERVED_OPTIONS = {
    "tpustream": {
        "num_classes": "data.num_classes",
        "image_size": "data.image_size",
        "channels": "data.channels",
    },
    "timm": {"num_classes": "data.num_classes", "in_chans": "data.channels"},
    "torchvision": {"num_classes": "data.num_classes"},
}


def check_reserved_options(options: dict, library: str = "tpustream") -> None:
    """ConfigError naming the data.* key to use when model.options sets what tpustream takes from the data."""
    reserved = RESERVED_OPTIONS.get(library, {})
    for option in options:
        if option in reserved:
            raise ConfigError(
                f"model.options.{option}: tpustream gives the model its {option} from the data; "
                f"set {reserved[option]} instead"
            )


def check_model_options(name: str, options: dict, library: str = "tpustream") -> None:
    """Fail before spawning if the name is unknown or a built-in family does not take the options.

    timm's and torchvision's constructors take **kwargs through several
    layers, so their options are checked by building the model
    (check_model_builds) instead of by signature.
    """
    check_reserved_options(options, library)
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


def check_model_config(model: ModelConfig) -> None:
    """model.*, before spawning: the name exists in its library (close matches named if not), a
    built-in family takes the options, and the library has the weights model.pretrained asks for.

    Every model is also built and run on the meta device with the data's
    shapes (check_model_builds, from launch.checks.check_data), which catches
    the option values and input sizes a constructor refuses.
    """
    library = ModelLibrary(model.library).value
    check_model_options(model.name, dict(model.options), library)
    if model.pretrained is not None:
        # Imported here: storage (which reads the weights' files) only when weights are named.
        from tpustream.models.pretrained import check_pretrained

        check_pretrained(library, model.name, model.pretrained)


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
    shapes = f"{where} with model.options {options} on {channels}x{height}x{width} images"
    check_reserved_options(options, library)
    with torch.device("meta"):
        try:
            model = create_model(
                name,
                num_classes=num_classes,
                image_size=max(height, width),
                channels=channels,
                library=library,
                **options,
            )
        except ConfigError:
            raise
        except Exception as exc:  # the constructor refused an option: its own words
            raise ConfigError(f"{shapes}: {describe_exception(exc)}") from None
        try:
            out = model(torch.empty(2, channels, height, width))
        except Exception as exc:  # built, but not for this input: name what sets the input size
            raise ConfigError(
                f"{shapes}: {describe_exception(exc)}{input_size_hint(model, library, options)}"
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


def describe_exception(exc: Exception) -> str:
    """A library's exception as its class and first line."""
    if not str(exc).strip():
        return exc.__class__.__name__
    # timm's assertions end in a full stop; the message goes on after it.
    return f"{exc.__class__.__name__}: {str(exc).strip().splitlines()[0].rstrip('.')}"


def input_size_hint(model: nn.Module, library: str, options: dict) -> str:
    """What a timm model that fails on this input size takes instead ('' where nothing can be said).

    Only for a forward pass that failed, of a model whose constructor takes
    img_size: a constructor's refusal is about its options, and a CNN has no
    img_size to set, so naming it there points the wrong way.
    """
    if library != "timm" or "img_size" in options:
        return ""
    if "img_size" not in inspect.signature(type(model).__init__).parameters:
        return ""
    made_for = (getattr(model, "pretrained_cfg", None) or {}).get("input_size")
    size = f"; this one is made for {made_for[-2]}x{made_for[-1]}" if made_for else ""
    return f"; timm models made for another input size take model.options.img_size (and patch_size){size}"


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
