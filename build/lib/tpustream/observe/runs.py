"""The runs tpustream-report reads: a run folder, or each job of a Hydra multirun folder.

A run folder is one that train.py has written to: metrics.jsonl once an epoch
has finished, config.yaml and checkpoints/last.pt from its first minutes. A
Hydra multirun folder holds one folder per job whose .hydra/ records the
job's config and Hydra's own; the config is stored unresolved, so the job's
output_dir is resolved here from both.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from tpustream import storage
from tpustream.checkpoint import CHECKPOINTS, CONFIG, LAST, METRICS

# What train.py writes into a run folder before its first epoch ends, and after.
RUN_MARKERS = (METRICS, CONFIG, f"{CHECKPOINTS}/{LAST}")
# Hydra's `${hydra:key}` resolver reads the job's HydraConfig, which exists only
# inside the job; `${hydra.key}` reads the same value from the saved hydra.yaml.
HYDRA_RESOLVER = re.compile(r"\$\{hydra:\s*([^}]+?)\s*\}")


@dataclass
class Run:
    url: str
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    # For a run without a finished epoch: what its folder holds instead.
    note: str | None = None

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]


def read_yaml(url: str) -> dict[str, Any]:
    """A YAML file as plain data, interpolations left as written ({} where there is none)."""
    from omegaconf import OmegaConf

    if not storage.exists(url):
        return {}
    loaded = OmegaConf.to_container(OmegaConf.create(storage.read_bytes(url).decode()), resolve=False)
    return loaded if isinstance(loaded, dict) else {}


def is_run_folder(url: str) -> bool:
    return any(storage.exists(storage.join(url, *marker.split("/"))) for marker in RUN_MARKERS)


def read_run(url: str) -> Run:
    """A run's epochs from metrics.jsonl; without one, what its last.pt says about its first epoch."""
    from tpustream.checkpoint import read_metrics

    run = Run(url, read_metrics(url), read_yaml(storage.join(url, CONFIG)))
    if not run.records:
        run.records, run.note = read_unfinished(url)
    return run


def read_unfinished(url: str) -> tuple[list[dict[str, Any]], str]:
    """A run folder without metrics.jsonl: the history its last.pt holds, and what the run got to."""
    from tpustream.checkpoint import CheckpointError, load_checkpoint

    last = storage.join(url, CHECKPOINTS, LAST)
    if not storage.exists(last):
        return [], "no epoch finished yet, and no checkpoint saved: the run was just starting"
    try:
        state = load_checkpoint(last)
    except CheckpointError as exc:
        return [], f"no epoch finished yet; {exc}"
    history = list(state.get("history") or [])
    if history:  # metrics.jsonl could not be written (the trainer says so and goes on)
        return history, f"no metrics.jsonl: the epochs are {CHECKPOINTS}/{LAST}'s history"
    position = state["position"]
    steps = (state.get("data_plan") or {}).get("steps_per_epoch")
    of = f" of {steps}" if steps else ""
    return [], (
        f"no epoch finished yet: {CHECKPOINTS}/{LAST} is at epoch {position['epoch']}, "
        f"step {position['step']}{of}; the same command continues it"
    )


def job_output_dir(job: str) -> str | None:
    """A Hydra job folder's output_dir, resolved from its .hydra/config.yaml and .hydra/hydra.yaml.

    Hydra saves the job's config unresolved (output_dir defaults to
    ${hydra:runtime.output_dir}) and its own config with runtime.output_dir
    and runtime.cwd filled in; a relative output_dir was taken from that cwd.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    config = read_yaml(os.path.join(job, ".hydra", "config.yaml"))
    hydra = read_yaml(os.path.join(job, ".hydra", "hydra.yaml")).get("hydra") or {}
    value = config.get("output_dir")
    if not isinstance(value, str) or not value:
        return None
    merged = OmegaConf.create({"output_dir": HYDRA_RESOLVER.sub(r"${hydra.\1}", value), "hydra": hydra})
    try:
        output_dir = str(merged.output_dir)
    except OmegaConfBaseException:  # a resolver only the job had (${now:...}, a custom one)
        return None
    if storage.scheme_name(output_dir):
        return output_dir
    return os.path.join((hydra.get("runtime") or {}).get("cwd") or job, os.path.expanduser(output_dir))


def find_runs(url: str) -> list[Run]:
    """The run in a run folder, or the runs of a Hydra multirun folder (each job's output_dir)."""
    if is_run_folder(url):
        return [read_run(url)]
    if storage.is_gcs(url):
        raise FileNotFoundError(f"{url}: no run there (none of {', '.join(RUN_MARKERS)})")
    if not os.path.exists(url):
        raise FileNotFoundError(f"{url} does not exist")
    if not os.path.isdir(url):
        raise FileNotFoundError(f"{url}: not a run folder, nor a Hydra multirun folder")
    runs = []
    for job in sorted(os.listdir(url), key=lambda name: (len(name), name)):
        output_dir = job_output_dir(os.path.join(url, job))
        if output_dir and is_run_folder(output_dir):
            runs.append(read_run(output_dir))
    if not runs:
        raise FileNotFoundError(
            f"{url}: no run in it ({', '.join(RUN_MARKERS)}) nor in the output_dir of any job folder"
        )
    return runs
