"""The gcloud commands of a pod launch, and the shell code they run on the hosts.

Pure: they build argv lists and shell strings (tested without gcloud); the
modules that run them are `tpu`, `workers` and `sync`.
"""

from __future__ import annotations

import os
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from tpustream.pod.multislice import megascale_env
from tpustream.pod.spec import LaunchSpec

# ssh (so gcloud ssh) exits with 255 when the connection fails or is lost,
# e.g. when a preemptible TPU VM is taken away.
CONNECTION_LOST_EXIT_CODE = 255
# scripts/create_tpu_pod.sh's start-up script writes this when python3-venv is
# installed; --sync waits for it (at most STARTUP_WAIT_SECONDS) on a new TPU VM.
STARTUP_MARKER = "/var/lib/tpustream/startup-done"
STARTUP_WAIT_SECONDS = 600
# The cleanup sends SIGTERM, then SIGKILL to what is left after this long
# (a replica stuck in a collective may never act on SIGTERM).
CLEANUP_KILL_AFTER_SECONDS = 10
# In the ssh user's home on each host: RUN_ID.WORKER.pid holds the process group
# that worker's training leads. A file is left behind when its training ends by
# itself (nothing runs after the exec that could remove it): a few bytes per
# launch, and harmless, since only a file of the current launch is ever read,
# and only a group carrying its run id is stopped.
RUNS_DIR = ".tpustream/runs"
# Set in the training's environment, so inherited by its replicas and workers: the
# cleanup stops a recorded group only if a process in it carries this launch's id.
RUN_ID_VARIABLE = "TPUSTREAM_RUN_ID"


def gcloud_tpu(spec: LaunchSpec, verb: str, *args: str) -> list[str]:
    """``gcloud compute tpus tpu-vm VERB ARGS --zone=Z [--project=P]``."""
    project = [f"--project={spec.project}"] if spec.project else []
    return [spec.gcloud, "compute", "tpus", "tpu-vm", verb, *args, f"--zone={spec.zone}", *project]


@dataclass(frozen=True)
class Worker:
    """One host of a launch: host ``host`` of the TPU VM ``node``, slice ``slice`` of ``slices``."""

    node: str
    host: int
    slice: int = 0
    slices: int = 1

    def __str__(self) -> str:
        return f"slice {self.slice} worker {self.host}" if self.slices > 1 else f"worker {self.host}"

    @property
    def key(self) -> str:
        """Unique among the launch's hosts: names its pid file (a home may be shared by several)."""
        return f"{self.slice}-{self.host}" if self.slices > 1 else str(self.host)


def launch_workers(spec: LaunchSpec, hosts_per_slice: int) -> list[Worker]:
    """Every host of the launch, slice by slice."""
    return [
        Worker(node, host, index, spec.num_slices)
        for index, node in enumerate(spec.nodes)
        for host in range(hosts_per_slice)
    ]


def describe_command(spec: LaunchSpec, node: str) -> list[str]:
    return gcloud_tpu(spec, "describe", node, "--format=json")


def ssh_command(spec: LaunchSpec, node: str, worker: int | str, remote: str) -> list[str]:
    """Run the shell command ``remote`` on one worker of ``node``, or on all at once with worker="all".

    gcloud hands ``remote`` to ssh, and sshd to the user's login shell: it is
    parsed by a shell exactly once, on the host.
    """
    return gcloud_tpu(spec, "ssh", node, f"--worker={worker}", f"--command={remote}")


def scp_command(spec: LaunchSpec, node: str, local: str, remote_path: str) -> list[str]:
    return gcloud_tpu(spec, "scp", local, f"{node}:{remote_path}", "--worker=all")


def shell_path(path: str) -> str:
    """A path for a shell: quoted, except a leading ``~/`` (quoting it would stop tilde expansion)."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        rest = path[2:].strip("/")
        return f"~/{shlex.quote(rest)}" if rest else "~"
    return shlex.quote(path)


def new_run_id() -> str:
    """A fresh id per launch: it names the launch's pid files and marks its processes."""
    return secrets.token_hex(8)


def remote_run_command(spec: LaunchSpec, worker: Worker, run_id: str, coordinator: str | None = None) -> str:
    """``cd WORKDIR && setsid --wait sh -c RECORD tpustream env PJRT_DEVICE=TPU K=V ... COMMAND; exit $?``.

    Overrides such as ``data.train_shards=gs://b/train-{000000..000639}.tar`` or
    ``name='a b'`` must reach train.py as typed, not brace- or glob-expanded:
    every user token is quoted once for the host's shell, and RECORD passes them
    on with ``exec "$@"``. TPUSTREAM_HOST_INDEX tells train.py which host it runs
    on within its slice: only host 0 (of slice 0) counts shards without recorded
    sample counts, the others wait for its index. With several slices the
    MEGASCALE_* variables join them (tpustream.pod.multislice); ``coordinator``
    is the address of slice 0's first host.

    So that the cleanup stops this training and nothing else, the command leads
    a new process group (setsid) and RECORD writes that group's id, its own pid,
    to ``~/RUNS_DIR/RUN_ID.WORKER.pid`` before it execs env and COMMAND: the exec
    chain keeps the pid, so COMMAND itself leads the group and gets the
    cleanup's SIGTERM, and its exit code is the shell's. ``; exit $?`` keeps the
    login shell from exec'ing setsid (bash and dash do that with the last
    command): the login shell leads a group, and setsid called from a group
    leader has to fork. --wait makes a forked setsid still pass the exit code on.
    """
    if worker.slices > 1 and not coordinator:
        raise ValueError("several slices need the coordinator's address")
    assignments = [
        ("PJRT_DEVICE", "TPU"),
        ("TPUSTREAM_HOST_INDEX", str(worker.host)),
        *megascale_env(worker.slices, worker.slice, coordinator or ""),
        *spec.env,
        (RUN_ID_VARIABLE, run_id),  # last: an --env of the same name must not hide the training
    ]
    env = " ".join(shlex.quote(f"{name}={value}") for name, value in assignments)
    record = (
        f'mkdir -p "$HOME/{RUNS_DIR}" && echo $$ > "$HOME/{RUNS_DIR}/{run_id}.{worker.key}.pid" && exec "$@"'
    )
    return (
        f"cd {shell_path(spec.workdir)} && setsid --wait sh -c {shlex.quote(record)} tpustream "
        f"env {env} {shlex.join(spec.command)}; exit $?"
    )


def worker_commands(
    spec: LaunchSpec, workers: Sequence[Worker], run_id: str, coordinator: str | None = None
) -> list[list[str]]:
    """One gcloud ssh per worker, so each process's output belongs to one host."""
    return [
        ssh_command(spec, w.node, w.host, remote_run_command(spec, w, run_id, coordinator)) for w in workers
    ]


def preflight_command(spec: LaunchSpec) -> list[str]:
    """One ssh before the concurrent ones: gcloud creates and publishes the SSH key only once."""
    return ssh_command(spec, spec.nodes[0], 0, "true")


def process_tokens(command: Sequence[str]) -> list[str]:
    """The tokens that name the training in messages: the program and its script or module.

    ``.venv/bin/python train.py ...`` -> ``.venv/bin/python train.py``;
    ``python -m pkg.mod ...`` -> ``python -m pkg.mod``.
    """
    for index, token in enumerate(command[1:], start=1):
        if not token.startswith("-"):
            return list(command[: index + 1])
    return list(command)


def cleanup_script(run_id: str) -> str:
    """Shell code that stops this launch's training on one host, and nothing else.

    The process groups come from the pid files this launch's commands wrote
    (see remote_run_command), not from a command-line pattern: a colleague's
    run of the same train.py, or a ``tail -f`` of a file named like it, matches
    a pattern too. A recorded group is stopped only if one of its live processes
    carries ``TPUSTREAM_RUN_ID=RUN_ID``: the file outlives a training that ended
    by itself, and by now its number may lead someone else's group. The whole
    group, not one pid: xmp.spawn's replicas and DataLoader workers do not run
    train.py but share its group. SIGTERM first (train.py saves and exits),
    SIGKILL for whatever is left after CLEANUP_KILL_AFTER_SECONDS. Every file of
    the launch is read, as a home shared by several hosts holds them all.
    """
    marker = shlex.quote(f"{RUN_ID_VARIABLE}={run_id}")
    rounds = CLEANUP_KILL_AFTER_SECONDS * 2
    return (
        # Zombies do not count: they are dead, and may wait a while for their reaper.
        "members() { ps -eo pid=,pgid=,stat= | awk -v g=\"$1\" '$2 == g && $3 !~ /^Z/ {print $1}'; }; "
        "groups=; "
        f'for f in "$HOME"/{RUNS_DIR}/{run_id}.*.pid; do '
        '[ -f "$f" ] || continue; g=$(cat "$f"); '
        'for p in $(members "$g"); do '
        f"if tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | grep -qxF {marker}; "
        'then groups="$groups $g"; break; fi; '
        "done; done; "
        '[ -n "$groups" ] || exit 0; '
        'echo "$(hostname): stopping process group(s)$groups"; '
        'left() { for g in $groups; do [ -z "$(members "$g")" ] || return 0; done; return 1; }; '
        # No "--" before the negative group id: dash's kill takes none.
        'for g in $groups; do kill -TERM "-$g" 2>/dev/null; done; '
        f"for i in $(seq {rounds}); do left || exit 0; sleep 0.5; done; "
        'for g in $groups; do kill -KILL "-$g" 2>/dev/null; done; exit 0'
    )


def cleanup_commands(spec: LaunchSpec, run_id: str) -> list[list[str]]:
    """One per node: every host of it stops this launch's training."""
    return [ssh_command(spec, node, "all", cleanup_script(run_id)) for node in spec.nodes]


def leftovers_commands(spec: LaunchSpec, run_id: str) -> list[list[str]]:
    """List what is left of this launch's training on every host: the processes carrying its run id."""
    marker = shlex.quote(f"{RUN_ID_VARIABLE}={run_id}")
    listing = (
        f"grep -lxzF {marker} /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | xargs -r ps -o pid=,args= -p"
    )
    return [ssh_command(spec, node, "all", listing) for node in spec.nodes]


def sync_script(spec: LaunchSpec, remote_tarball: str) -> str:
    """Shell code run on every host by --sync: unpack the code into workdir and install it.

    On a new TPU VM the start-up script may still be installing python3-venv:
    wait for its marker (only if its directory exists, i.e. the VM was made
    by scripts/create_tpu_pod.sh), at most STARTUP_WAIT_SECONDS.
    """
    workdir, tarball = shell_path(spec.workdir), shlex.quote(remote_tarball)
    marker, marker_dir = STARTUP_MARKER, os.path.dirname(STARTUP_MARKER)
    return (
        f"i=0; while [ -d {marker_dir} ] && [ ! -e {marker} ] && [ $i -lt {STARTUP_WAIT_SECONDS // 5} ]; "
        "do sleep 5; i=$((i+1)); done; "
        f"mkdir -p {workdir} && tar -xzf {tarball} -C {workdir} && rm -f {tarball} && cd {workdir} && "
        "python3 -m venv .venv && .venv/bin/pip install --quiet -e '.[tpu]'"
    )


def sync_commands(spec: LaunchSpec, local_tarball: str, remote_tarball: str) -> list[list[str]]:
    """Copy the tarball to every host, then unpack and install it there; node by node."""
    script = sync_script(spec, remote_tarball)
    return [
        argv
        for node in spec.nodes
        for argv in (
            scp_command(spec, node, local_tarball, remote_tarball),
            ssh_command(spec, node, "all", script),
        )
    ]


def new_remote_tarball() -> str:
    """A fresh name per launch: two launches on one TPU must not unpack each other's code."""
    return f"/tmp/tpustream-src-{secrets.token_hex(4)}.tar.gz"


def dry_run_lines(spec: LaunchSpec) -> list[str]:
    """The gcloud commands a launch runs, shell-quoted, one per line; ``#`` lines explain."""
    quote = shlex.join
    shown = spec.num_workers or 1
    multislice = spec.num_slices > 1
    lines = ["# dry run: nothing is run"]
    if spec.num_workers is None or multislice:
        lines += [quote(describe_command(spec, node)) for node in spec.nodes]
        said = ["the number of workers (len(networkEndpoints))"] if spec.num_workers is None else []
        said += [f"COORDINATOR, the address of {spec.nodes[0]}'s first host"] if multislice else []
        per_slice = " of each slice" if multislice else ""
        shown_as = f"; worker commands shown for 1{per_slice}" if spec.num_workers is None else ""
        lines.append(f"# describe gives {' and '.join(said)}{shown_as}")
    if spec.sync:
        root = spec.source or "the tpustream checkout"
        lines.append(f"# --sync: LOCAL_TARBALL is a .tar.gz of the git-tracked files of {root}")
        lines += [quote(argv) for argv in sync_commands(spec, "LOCAL_TARBALL", new_remote_tarball())]
    else:
        lines.append(quote(preflight_command(spec)))
    run_id = new_run_id()
    lines.append(
        f"# each worker records its process group in ~/{RUNS_DIR}/{run_id}.WORKER.pid "
        f"({run_id} is new for every launch)"
    )
    coordinator = "COORDINATOR" if multislice else None
    lines += [quote(argv) for argv in worker_commands(spec, launch_workers(spec, shown), run_id, coordinator)]
    lines.append("# if a worker fails, the others are stopped and this stops the recorded groups:")
    lines += [quote(argv) for argv in cleanup_commands(spec, run_id)]
    if spec.restart:
        lines.append(
            f"# --restart: after exit {PREEMPTED_EXIT_CODE}, {HUNG_EXIT_CODE} or "
            f"{CONNECTION_LOST_EXIT_CODE}, describe until "
            f"READY (every {spec.poll_interval:g}s), then all of the above again, at most "
            f"{spec.max_restarts} time(s)"
        )
    return lines
