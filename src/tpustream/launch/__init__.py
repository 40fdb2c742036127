"""Starting training: on this host (`local`: checks, spawn, one replica's set-up) or on a TPU pod (`pod`).

`local` is imported on first use of one of its names: it imports torch, and
``python -m tpustream.launch`` (the pod launcher, `pod`) must start fast and
needs only the standard library on the machine it runs on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["RunPlan", "describe_result", "launch", "prepare", "resolve_config"]

if TYPE_CHECKING:
    from tpustream.launch.local import RunPlan, describe_result, launch, prepare, resolve_config


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("tpustream.launch.local"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
