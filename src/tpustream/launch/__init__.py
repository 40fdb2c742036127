"""Starting training: on this host or on a TPU pod (`pod`).

On this host: `checks` (config and data, before anything starts), `plan`
(the run plan), `spawn` (one entry, a way per kind of run: xmp.spawn, the
simulated pod, a GSPMD process), `replica` (one replica's set-up).

These are imported on first use of one of their names: they import torch, and
``python -m tpustream.launch`` (the pod launcher, `pod`) must start fast and
needs only the standard library on the machine it runs on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RunPlan", "describe_result", "launch", "prepare", "resolve_config"]

if TYPE_CHECKING:
    from tpustream.launch.checks import resolve_config
    from tpustream.launch.plan import RunPlan, describe_result, prepare
    from tpustream.launch.spawn import launch

_HOMES = {
    "RunPlan": "plan",
    "describe_result": "plan",
    "prepare": "plan",
    "launch": "spawn",
    "resolve_config": "checks",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"tpustream.launch.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
