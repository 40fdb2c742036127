"""model.pretrained: start from pretrained weights, with the head replaced when the classes differ.

The weights are a file (PATH_OR_URL: a state dict in safetensors or torch
format, timm's and torchvision's own files, ``save_file(model.state_dict())``,
a tpustream checkpoint; a local path, gs:// or http(s)://) or, with ``true``,
the library's own weights for model.name (timm's from the Hugging Face hub,
torchvision's weights enum), loaded by the library itself so that its
adaptations apply. Either way they are read once per host, before any replica
starts, checked against the configured model there (the classifier head, every
tensor whose shape follows the class count, may differ in shape: it is left
freshly initialised, and the log says which tensors; any other difference is
an error naming them), then written to a local file that every replica of
the host loads: replicas never download.
"""

from __future__ import annotations

import io
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from tpustream import storage
from tpustream.errors import ConfigError, StorageError
from tpustream.models.shapes import describe_state_difference

log = logging.getLogger(__name__)

# Wrappers a state dict comes in: timm's train checkpoints, ours, Lightning's.
STATE_KEYS = ("state_dict", "model", "state_dict_ema", "model_state_dict")
# Prefixes that wrappers add to every key (DistributedDataParallel, torch.compile).
KEY_PREFIXES = ("module.", "_orig_mod.")
# model.pretrained=<a torchvision weights name> (IMAGENET1K_V2), told apart from a file by its shape.
WEIGHTS_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# Where the libraries keep what they download, for the advice on a failed fetch.
HF_CACHE = "its Hugging Face cache (HF_HOME or HF_HUB_CACHE; with HF_HUB_OFFLINE=1 only the cache is read)"
TORCH_CACHE = "its torch hub cache (TORCH_HOME/hub/checkpoints, TORCH_HOME defaults to ~/.cache/torch)"


def read_state_dict(url: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors or torch file at url (local, gs://, http(s)://), keys unwrapped."""
    try:
        data = storage.read_bytes(url)
    except StorageError as exc:
        raise ConfigError(f"model.pretrained: {exc}") from None
    try:
        from safetensors.torch import load as load_safetensors

        state: object = load_safetensors(data)
    except Exception:  # not safetensors: a torch file, or neither
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(
                f"model.pretrained={url}: neither a safetensors nor a torch state dict "
                f"({exc.__class__.__name__})"
            ) from None
    while isinstance(state, Mapping) and not _is_state_dict(state):
        inner = next((state[k] for k in STATE_KEYS if isinstance(state.get(k), Mapping)), None)
        if inner is None:
            break
        state = inner
    if not (isinstance(state, Mapping) and _is_state_dict(state)):
        raise ConfigError(f"model.pretrained={url}: holds no state dict of tensors")
    return {_strip(key): tensor for key, tensor in state.items()}


def _is_state_dict(state: Mapping) -> bool:
    return bool(state) and all(isinstance(v, torch.Tensor) for v in state.values())


def _strip(key: str) -> str:
    for prefix in KEY_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def classifier_names(model: nn.Module, build: Callable[..., nn.Module] | None = None) -> set[str]:
    """The state-dict keys of the model's head: the tensors whose shapes follow its class count.

    build(num_classes=k) builds the model for k classes (launch.run_model's
    model_builder); it is built for 1 and 2 on the meta device and the tensors
    whose shapes differ are the head, whatever its kind: a Linear, a
    Sequential ending in one, SqueezeNet's 1x1 convolution, a ViT's head and
    distillation head, Inception's auxiliary classifiers. Naming it by rule
    (timm's pretrained_cfg, else the last Linear) missed the convolution and
    the auxiliary heads, and called their weights of another class count
    another architecture; the rule is left for a model without a builder.
    """
    if build is None:
        return classifier_names_by_rule(model)
    try:
        with torch.device("meta"):
            one, two = (build(num_classes=count) for count in (1, 2))
    except Exception as exc:  # a constructor that refuses 1 or 2 classes: the rule decides
        log.info(
            "model.pretrained: the head of %s is named by rule: it cannot be built for 1 and 2 classes (%s)",
            type(model).__name__,
            describe_exception(exc),
        )
        return classifier_names_by_rule(model)
    one_shapes = {key: tuple(t.shape) for key, t in one.state_dict().items()}
    two_shapes = {key: tuple(t.shape) for key, t in two.state_dict().items()}
    return {key for key in model.state_dict() if one_shapes.get(key) != two_shapes.get(key)}


def classifier_names_by_rule(model: nn.Module) -> set[str]:
    """The state-dict keys of the model's head: timm's pretrained_cfg names it, else the last Linear."""
    prefixes = getattr(model, "pretrained_cfg", None) or {}
    prefixes = prefixes.get("classifier") if isinstance(prefixes, Mapping) else None
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    if not prefixes:
        linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        prefixes = linear[-1:]
    keys = model.state_dict().keys()
    return {key for key in keys for prefix in prefixes if key.startswith(f"{prefix}.")}


def match_pretrained(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    source: str,
    build: Callable[..., nn.Module] | None = None,
) -> list[str]:
    """The head tensors to leave freshly initialised; ConfigError naming tensors that do not fit otherwise.

    build: what builds the model for a class count (classifier_names).
    """
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    given = {name: tuple(t.shape) for name, t in state.items()}
    head = classifier_names(model, build)
    # A head absent from the file (a backbone's weights: timm's num_classes=0) is
    # left fresh too; load_pretrained takes exactly these as its missing keys.
    replaced = sorted(n for n in head if given.get(n) != wanted[n])
    difference = describe_state_difference(wanted, given, "in the file", "here", ignore=head)
    if difference is not None:
        raise ConfigError(f"model.pretrained={source} holds weights of another architecture: {difference}")
    return replaced


def fetch_pretrained(
    model_on_meta: nn.Module, url: str, build: Callable[..., nn.Module] | None = None
) -> tuple[str, list[str]]:
    """Read and check the file once on this host: (a local copy for the replicas, the heads replaced)."""
    state = read_state_dict(url)
    replaced = match_pretrained(model_on_meta, state, url, build)
    return write_host_copy(state, replaced, f"model.pretrained={url}")


def write_host_copy(
    state: Mapping[str, torch.Tensor], replaced: list[str], source: str
) -> tuple[str, list[str]]:
    """The checked weights, less the replaced head, in a local file for this host's replicas; logged."""
    kept = {name: t for name, t in state.items() if name not in replaced}
    handle, local = tempfile.mkstemp(prefix="tpustream-pretrained-", suffix=".pt")
    with os.fdopen(handle, "wb") as out:
        torch.save(kept, out)
    if replaced:
        resized = [name for name in replaced if name in state]
        absent = [name for name in replaced if name not in state]
        heads = [f"the head ({', '.join(resized)}) holds another number of classes"] if resized else []
        heads += [f"the head ({', '.join(absent)}) is not in the weights"] if absent else []
        log.info(
            "%s: %d tensors loaded; %s and starts freshly initialised", source, len(kept), " and ".join(heads)
        )
    else:
        log.info("%s: %d tensors loaded", source, len(kept))
    return local, replaced


def library_weights(library: str, name: str, value: str) -> str | None:
    """The library weights model.pretrained names ("DEFAULT" for true, or a weights name); None: a file."""
    if value.lower() == "true":
        return "DEFAULT"
    if library == "torchvision" and WEIGHTS_NAME.fullmatch(value) and not os.path.exists(value):
        return value
    return None


def check_pretrained(library: str, name: str, value: str) -> None:
    """ConfigError unless the library has the weights model.pretrained asks for (nothing is downloaded)."""
    if not value.strip():
        raise ConfigError(
            "model.pretrained is empty: give true (the library's weights for model.name), the weights' "
            "file (a path, gs:// or http(s):// URL), or null"
        )
    if value.lower() == "false":
        return
    weights = library_weights(library, name, value)
    if weights is None:
        return
    if library == "timm":
        timm_weights_source(name)
    elif library == "torchvision":
        torchvision_weights(name, weights)
    else:
        raise ConfigError(
            f"model.pretrained={value} for model={name}: tpustream's built-in models have no pretrained "
            f"weights; use model=timm or model=torchvision (e.g. model=timm model.name={name} "
            "model.pretrained=true), or model.pretrained=PATH to a file of weights"
        )


def timm_weights_source(name: str) -> tuple[str, bool]:
    """Where timm fetches the weights of `name` (tag included), and if from the hub; ConfigError: none."""
    import timm
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError as exc:  # an unknown tag: "Invalid pretrained tag (x) for resnet18."
        cfg, reason = None, str(exc).rstrip(".")
    else:
        reason = "timm has no pretrained weights for it"
    if cfg is not None and cfg.hf_hub_id:  # timm prefers the hub where a name has both
        return f"{cfg.hf_hub_id} on the Hugging Face hub", True
    if cfg is not None and (cfg.url or cfg.file):
        return cfg.url or cfg.file, False
    architecture = name.split(".")[0]
    tagged = timm.list_models(architecture, pretrained=True) or timm.list_models(
        f"{architecture.split('_')[0]}*", pretrained=True
    )
    hint = f" (with weights: {', '.join(tagged[:5])}{', ...' if len(tagged) > 5 else ''})" if tagged else ""
    raise ConfigError(
        f"model=timm model.name={name} model.pretrained=true: {reason}; give a name that has them"
        f"{hint}, or model.pretrained=PATH to a file of weights"
    )


def torchvision_weights(name: str, weights: str):
    """The member `weights` (DEFAULT, or a name like IMAGENET1K_V2) of the weights enum of `name`."""
    from torchvision.models import get_model_weights

    try:
        members = get_model_weights(name).__members__
    except (KeyError, ValueError):
        members = {}
    if weights not in members:
        known = f"it has {', '.join(members)}" if members else "torchvision has none for it"
        raise ConfigError(
            f"model=torchvision model.name={name} model.pretrained={weights}: no such weights ({known}); "
            "give true (DEFAULT), one of those names, or model.pretrained=PATH to a file of weights"
        )
    return members[weights]


def fetch_library_pretrained(
    model_on_meta: nn.Module,
    library: str,
    name: str,
    weights: str,
    *,
    num_classes: int,
    channels: int,
    options: Mapping,
    build: Callable[..., nn.Module] | None = None,
) -> tuple[str, list[str]]:
    """The library's own weights, fetched and adapted by the library once on this host, like fetch_pretrained.

    Built on the CPU by the library itself, so its loading rules apply:
    timm resizes position embeddings to img_size, adapts the stem to
    in_chans and drops a head of another class count; torchvision renames
    the keys of old files (DenseNet). Only this process downloads: the
    replicas load the local copy, so eight never race into one cache.
    """
    if library == "timm":
        state, replaced, source = read_timm_weights(
            name, num_classes=num_classes, channels=channels, options=options
        )
        return write_host_copy(state, replaced, source)
    enum_member = torchvision_weights(name, weights)
    asked = "true" if weights == "DEFAULT" else weights
    source = f"model.pretrained={asked} ({type(enum_member).__name__}.{enum_member.name})"
    state = read_torchvision_weights(name, enum_member, options, asked)
    replaced = match_pretrained(model_on_meta, state, source, build)
    return write_host_copy(state, replaced, source)


def read_timm_weights(
    name: str, *, num_classes: int, channels: int, options: Mapping
) -> tuple[dict[str, torch.Tensor], list[str], str]:
    """timm.create_model(name, pretrained=True) for this data: (state dict, head left fresh, label)."""
    import timm

    where, from_hub = timm_weights_source(name)
    try:
        model = timm.create_model(
            name, pretrained=True, num_classes=num_classes, in_chans=channels, **options
        )
    except Exception as exc:
        advice = fetch_advice(exc, HF_CACHE if from_hub else TORCH_CACHE)
        raise ConfigError(
            f"model=timm model.name={name} model.pretrained=true: timm could not load its weights "
            f"({where}): {describe_exception(exc)}; {advice}"
        ) from None
    pretrained_cfg = model.pretrained_cfg
    classifiers = pretrained_cfg.get("classifier") or ()
    if isinstance(classifiers, str):
        classifiers = (classifiers,)
    state = model.state_dict()
    # timm's rule (timm.models._builder.load_pretrained): a head of another
    # class count is dropped from the file and keeps the model's initialisation.
    replaced = []
    if num_classes != pretrained_cfg.get("num_classes"):
        replaced = sorted(
            f"{c}.{kind}" for c in classifiers for kind in ("weight", "bias") if f"{c}.{kind}" in state
        )
    return state, replaced, f"model.pretrained=true (timm {name}: {where})"


def read_torchvision_weights(name: str, enum_member, options: Mapping, asked: str) -> dict[str, torch.Tensor]:
    """get_model(name, weights=enum_member), the weights' own class count: its state dict, or ConfigError."""
    from torchvision.models import get_model

    try:
        # progress=False: one line in the log, not a bar per host. The builder
        # checks the file's hash (in its name) as it downloads.
        model = get_model(name, weights=enum_member, progress=False, **options)
    except Exception as exc:
        where = enum_member.url
        raise ConfigError(
            f"model=torchvision model.name={name} model.pretrained={asked}: torchvision could "
            f"not load {type(enum_member).__name__}.{enum_member.name} ({where}): "
            f"{describe_exception(exc)}; {fetch_advice(exc, TORCH_CACHE)}"
        ) from None
    return model.state_dict()


def describe_exception(exc: BaseException) -> str:
    """The exception's class and the first line of its message, at most 200 characters."""
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else ""
    message = message if len(message) <= 200 else f"{message[:197]}..."
    return f"{exc.__class__.__name__}: {message}" if message else exc.__class__.__name__


def fetch_advice(exc: BaseException, cache: str) -> str:
    """What to do about a failed fetch (OSError: the network or the cache) or load (anything else)."""
    if not isinstance(exc, OSError):
        return "model.options may not fit these weights; or set model.pretrained=PATH to a file of weights"
    return (
        f"this host needs the network, or the weights already in {cache}; "
        "or set model.pretrained=PATH to a copy of the weights"
    )


def load_pretrained(model: nn.Module, local: str, replaced: list[str]) -> None:
    """A replica's model takes the host's checked copy (the replaced head keeps its initialisation)."""
    state = torch.load(local, map_location="cpu", weights_only=True)
    result = model.load_state_dict(state, strict=False)
    if sorted(result.missing_keys) != sorted(replaced) or result.unexpected_keys:
        raise ConfigError(f"model.pretrained: the checked copy {local} no longer fits the model ({result})")
