"""What a pod launch is: the LaunchSpec that ``__main__`` builds from the command line, checked."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tpustream.errors import ConfigError
from tpustream.pod.multislice import node_names
from tpustream.pod.types import slice_type

DEFAULT_WORKDIR = "~/tpustream"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# How a Hydra command line sets a key: key=v, +key=v (add it), ++key=v (add or override).


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a pod launch needs; built from the command line by ``__main__``."""

    tpu: str
    zone: str
    command: tuple[str, ...]  # what each host runs, e.g. (".venv/bin/python", "train.py", "accelerator=tpu")
    project: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # set on each host after PJRT_DEVICE=TPU
    workdir: str = DEFAULT_WORKDIR  # on each host; "~/" means the ssh user's home
    sync: bool = False
    source: Path | None = None  # what --sync copies; None: the checkout tpustream is installed from
    restart: bool = False
    max_restarts: int = 3
    num_workers: int | None = None  # None: ask describe
    grace: float = 30.0  # after a failure, seconds the other hosts get to finish on their own
    poll_interval: float = 30.0  # seconds between describe calls while waiting for READY
    ready_timeout: float = 3600.0
    # --recreate: a pod that was taken (PREEMPTED, TERMINATED, gone) is deleted and asked for again
    recreate: bool = False
    backoff: float = 60.0  # seconds before asking again after a request that failed; doubles each time
    create_timeout: float = 7200.0  # seconds a queued resource may wait for capacity
    # --type and --spot/--preemptible/--reserved: how to make the pod if it does not exist yet
    # and this machine has no record of it (then the first launch makes it, as `create` would)
    slice_type: str | None = None
    provisioning: str = "on-demand"
    # --num-slices: the pod is one queued resource of this many nodes, NAME-0 .. NAME-(N-1), one job
    num_slices: int = 1
    gcloud: str = "gcloud"

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("no command to run: put it after --, e.g. -- .venv/bin/python train.py")
        if not self.tpu or not self.zone:
            raise ConfigError("--tpu and --zone are required")
        if not self.workdir:
            raise ConfigError("--workdir must not be empty")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.restart and "resume=overwrite" in self.command:
            # Each relaunch would delete the progress its preempted run had saved.
            raise ConfigError(
                "--restart with resume=overwrite would start the run over at every restart; "
                "delete the old run once (or use another output_dir) and launch with resume=auto"
            )
        if self.num_workers is not None and self.num_workers < 1:
            raise ConfigError(f"--num-workers must be >= 1, got {self.num_workers}")
        if min(self.grace, self.poll_interval, self.ready_timeout, self.backoff, self.create_timeout) < 0:
            raise ConfigError(
                "--grace, --poll-interval, --ready-timeout, --backoff and --create-timeout must be >= 0"
            )
        if self.slice_type is not None:
            if not self.recreate:
                raise ConfigError("--type makes the pod if it is missing: it goes with --recreate")
            slice_type(self.slice_type)  # an unknown type: one line naming the known ones
        check_num_slices(self.num_slices, self.command)
        if self.num_slices > 1 and self.provisioning == "preemptible":
            raise ConfigError(
                "--num-slices with --preemptible: the slices are asked for as one queued resource, and "
                "preemptible TPU VMs have none; use --spot"
            )
        if self.recreate and not (self.restart and self.sync):
            # A recreated pod has new disks: without --sync the command would find no checkout there.
            raise ConfigError("--recreate needs --restart and --sync (a recreated pod has empty disks)")

    @property
    def nodes(self) -> tuple[str, ...]:
        """The TPU VMs the command runs on: the pod itself, or its slices' nodes (--num-slices)."""
        return node_names(self.tpu, self.num_slices)


def check_num_slices(slices: int, command: Iterable[str]) -> None:
    """--num-slices and the command's mesh.slices say the same (1 each when neither is given)."""
    if slices < 1:
        raise ConfigError(f"--num-slices must be at least 1, got {slices}")
    meshed = command_override(command, "mesh.slices")
    if (meshed or "1") != str(slices):
        said = f"sets mesh.slices={meshed}" if meshed else "sets no mesh.slices (1)"
        raise ConfigError(
            f"--num-slices {slices}, but the command {said}: add mesh.slices={slices} and strategy=spmd "
            "(docs/large-models.md, Multislice)"
        )


def parse_env(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """K=V strings to pairs; a bad name would otherwise become part of the remote command."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE with NAME made of letters, digits and _")
        pairs.append((name, value))
    return tuple(pairs)


def command_output_dir(command: Iterable[str]) -> str | None:
    """The output_dir a train.py command line sets (its last override, Hydra's quotes removed).

    None: the command leaves conf/config.yaml's default, the run's Hydra folder
    under outputs/ in the working directory of each host, which a fresh node
    does not have.
    """
    return command_override(command, "output_dir")


def command_override(command: Iterable[str], key: str) -> str | None:
    """The value a train.py command line gives a config key (its last override, Hydra's quotes removed)."""
    pattern = re.compile(rf"\+{{0,2}}{re.escape(key)}=(.*)\Z", re.S)
    value = None
    for token in command:
        match = pattern.match(token)
        if match:
            value = match.group(1)
    if value and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    return value


def is_bucket_url(path: str | None) -> bool:
    """A gs:// URL naming a bucket: what survives a pod's disks."""
    return path is not None and path.startswith("gs://") and bool(path[len("gs://") :].strip("/"))
