"""model.pretrained=PATH_OR_URL: start from weights in a file, with the head replaced when the classes differ.

The file is a state dict in safetensors or torch format (timm's and
torchvision's own files, ``save_file(model.state_dict())``, a tpustream
checkpoint), read from a local path, gs:// or http(s):// once per host,
before any replica starts: it is checked against the configured model there
(the classifier head may differ in shape: it is left freshly initialised, and
the log says which tensors; any other difference is an error naming them),
then written to a local file that every replica of the host loads.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
from collections.abc import Mapping

import torch
import torch.nn as nn

from tpustream import storage
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

# Wrappers a state dict comes in: timm's train checkpoints, ours, Lightning's.
STATE_KEYS = ("state_dict", "model", "state_dict_ema", "model_state_dict")
# Prefixes that wrappers add to every key (DistributedDataParallel, torch.compile).
KEY_PREFIXES = ("module.", "_orig_mod.")


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


def classifier_names(model: nn.Module) -> set[str]:
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


def match_pretrained(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> list[str]:
    """The head tensors to leave freshly initialised; ConfigError naming tensors that do not fit otherwise."""
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    given = {name: tuple(t.shape) for name, t in state.items()}
    head = classifier_names(model)
    replaced = sorted(n for n in head if n in given and given[n] != wanted[n])
    missing = sorted(set(wanted) - set(given) - head)
    unexpected = sorted(set(given) - set(wanted))
    differ = sorted(n for n in set(wanted) & set(given) if given[n] != wanted[n] and n not in head)
    if missing or unexpected or differ:
        parts = []
        if differ:
            first = differ[0]
            parts.append(
                f"{len(differ)} differ in shape (first {first}: {given[first]} in the file, "
                f"{wanted[first]} here)"
            )
        if missing:
            parts.append(f"{len(missing)} missing (first {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} not in the model (first {unexpected[0]})")
        raise ConfigError(
            f"model.pretrained={source} holds weights of another architecture: {'; '.join(parts)}"
        )
    return replaced


def fetch_pretrained(model_on_meta: nn.Module, url: str) -> tuple[str, list[str]]:
    """Read and check the file once on this host: (a local copy for the replicas, the heads replaced)."""
    state = read_state_dict(url)
    replaced = match_pretrained(model_on_meta, state, url)
    kept = {name: t for name, t in state.items() if name not in replaced}
    handle, local = tempfile.mkstemp(prefix="tpustream-pretrained-", suffix=".pt")
    with os.fdopen(handle, "wb") as out:
        torch.save(kept, out)
    if replaced:
        log.info(
            "model.pretrained=%s: %d tensors loaded; the head (%s) holds another number of classes and "
            "starts freshly initialised",
            url,
            len(kept),
            ", ".join(replaced),
        )
    else:
        log.info("model.pretrained=%s: %d tensors loaded", url, len(kept))
    return local, replaced


def load_pretrained(model: nn.Module, local: str, replaced: list[str]) -> None:
    """A replica's model takes the host's checked copy (the replaced head keeps its initialisation)."""
    state = torch.load(local, map_location="cpu", weights_only=True)
    result = model.load_state_dict(state, strict=False)
    if sorted(result.missing_keys) != sorted(replaced) or result.unexpected_keys:
        raise ConfigError(f"model.pretrained: the checked copy {local} no longer fits the model ({result})")
