"""What a resumed run may change, from each key's facts (config.keys): the fingerprint, the differences."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import Enum
from typing import Any

from tpustream.config.keys import OnResume, facts_of, flatten, is_known, key_names_where, leaf_keys

# The keys outside the fingerprint (config.keys.OnResume.ignore): longer runs, new
# folders, debugging, how often to evaluate, what to watch. Only epochs changes the
# training, where the lr schedule is drawn over it: optim.on_epochs_change decides how
# (training.schedule; launch.resume_checks.check_schedule_horizon refuses until it does).
FINGERPRINT_IGNORES = key_names_where(OnResume.ignore)
# Keys that may also differ when a run folder is continued with resume=auto (OnResume.change).
RESUME_MAY_DIFFER = key_names_where(OnResume.ignore, OnResume.change)
# Under a canonical partition these may change with the shape, the global batch kept
# (RunPlan.partition checks it).
SHAPE_MAY_DIFFER = key_names_where(OnResume.reshape)


def config_differences(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    ignore: tuple[str, ...] = FINGERPRINT_IGNORES,
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """The dotted keys whose values differ, as "key: saved -> current", leaving out `ignore` (and below).

    A key the saved config lacks (one added to tpustream since that run) is
    no difference when the current value is its default in `defaults`: the
    run was made under that default. A key only the saved config has, which
    tpustream no longer knows (data.name), is no difference either.
    """
    old, new = flatten(saved), flatten(current)
    known = flatten(defaults or {})
    differences = []
    for key in sorted(set(old) | set(new)):
        if any(key == name or key.startswith(f"{name}.") for name in ignore):
            continue
        if key not in old and key in known and new.get(key) == known[key]:
            continue
        if key not in new and not is_known(key):
            continue
        before, after = old.get(key, "(unset)"), new.get(key, "(unset)")
        if before != after:
            differences.append(f"{key}: {before} -> {after}")
    return differences


def schema_defaults() -> dict[str, Any]:
    """Every config key's schema default as plain data (for config_differences), by dotted name."""
    return {
        key.name: key.default.value if isinstance(key.default, Enum) else key.default for key in leaf_keys()
    }


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 of the config without the keys a resumed run may legitimately change."""
    return hashlib.sha256(
        json.dumps(_fingerprinted(config), sort_keys=True, default=str).encode()
    ).hexdigest()


def _fingerprinted(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    kept = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if facts_of(name).resume == OnResume.ignore:
            continue
        kept[key] = _fingerprinted(value, f"{name}.") if isinstance(value, Mapping) else value
    return kept
