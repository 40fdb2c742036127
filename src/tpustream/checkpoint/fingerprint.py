"""What a resumed run may change: the config keys a checkpoint's fingerprint ignores, their differences."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

# Keys whose change on resume is expected (longer runs, new folders, debugging,
# how often to evaluate, what to watch). Only epochs changes the training, where
# the lr schedule is drawn over it: optim.on_epochs_change decides how
# (training.schedule; launch.resume_checks.check_schedule_horizon refuses until it does).
FINGERPRINT_IGNORES = (
    "epochs",
    "output_dir",
    "log_dir",
    "resume",
    "eval_only",
    "debug",
    "watchdog",
    "early_stop_patience",
    "eval_every",
    "xla_cache_dir",
    "tensorboard",
)


# Keys that may also differ when a run folder is continued with resume=auto:
# where and on what it runs, how the model is laid out over the cores, and
# how its input is fed, none of which changes what is trained (another
# replica count or batch plan restarts the epoch).
RESUME_MAY_DIFFER = (
    *FINGERPRINT_IGNORES,
    "accelerator",
    "strategy",
    "fsdp_wrap_min_params",
    "checkpoint",
    "log_steps",
    "data.num_workers",
    "data.prefetch_factor",
    "data.streams",  # a resumed run keeps its checkpoint's partition
    # Where JPEGs are decoded: the same crops either way (pixels within a level, or the host's
    # DCT scaling); a GPU run continued on a TPU must switch to host.
    "data.decode",
    "optim.on_epochs_change",  # acts only when epochs changes; the checkpoint keeps the schedule's phase
)
# Under a canonical partition batch_size may change with the shape, the global
# batch kept (RunPlan.partition checks it).
SHAPE_MAY_DIFFER = ("batch_size",)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_differences(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    ignore: tuple[str, ...] = FINGERPRINT_IGNORES,
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """The dotted keys whose values differ, as "key: saved -> current", leaving out `ignore` (and below).

    A key the saved config lacks (one added to tpustream since that run) is
    no difference when the current value is its default in `defaults`: the
    run was made under that default.
    """
    old, new = _flatten(saved), _flatten(current)
    known = _flatten(defaults or {})
    differences = []
    for key in sorted(set(old) | set(new)):
        if any(key == name or key.startswith(f"{name}.") for name in ignore):
            continue
        if key not in old and key in known and new.get(key) == known[key]:
            continue
        before, after = old.get(key, "(unset)"), new.get(key, "(unset)")
        if before != after:
            differences.append(f"{key}: {before} -> {after}")
    return differences


def schema_defaults() -> dict[str, Any]:
    """Every config key's default as plain data (for config_differences), from the typed schema."""
    import dataclasses
    import typing

    from tpustream.config import TrainConfig

    defaults = OmegaConf.to_container(OmegaConf.structured(TrainConfig), enum_to_str=True)
    # The sections are MISSING in TrainConfig (conf/ chooses them): take each one's own defaults.
    for name, kind in typing.get_type_hints(TrainConfig).items():
        if dataclasses.is_dataclass(kind):
            defaults[name] = OmegaConf.to_container(OmegaConf.structured(kind), enum_to_str=True)
    return defaults


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 of the config without the keys a resumed run may legitimately change."""
    kept = {k: v for k, v in config.items() if k not in FINGERPRINT_IGNORES}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()
