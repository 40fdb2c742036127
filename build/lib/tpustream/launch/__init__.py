"""Starting training on this host (the pod launcher, which starts it on every host, is `tpustream.pod`).

`checks` (config and data, before anything starts), `resume_checks` (the
checkpoint's model and config), `plan` (the run plan), `spawn` (one entry, a
way per kind of run: xmp.spawn, the simulated pod, a GSPMD process), `replica`
(one replica's set-up).
"""

from tpustream.launch.checks import resolve_config
from tpustream.launch.plan import RunPlan, describe_result, prepare
from tpustream.launch.spawn import launch

__all__ = ["RunPlan", "describe_result", "launch", "prepare", "resolve_config"]
