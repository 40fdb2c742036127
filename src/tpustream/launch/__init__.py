"""Starting training: on this host (`local`: checks, spawn, one replica's set-up) or on a TPU pod (`pod`)."""

from tpustream.launch.local import RunPlan, launch, prepare, resolve_config

__all__ = ["RunPlan", "launch", "prepare", "resolve_config"]
