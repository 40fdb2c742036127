"""Settings read from the environment: the few that are not config keys, each checked where read."""

from __future__ import annotations

import math
import os

from tpustream.errors import ConfigError


def positive_seconds(name: str, default: float) -> float:
    """Environment variable `name` as a finite, positive number of seconds; ConfigError naming it if not."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"{name}={value!r}: expected a positive number of seconds (default {default:g})")
    return seconds
