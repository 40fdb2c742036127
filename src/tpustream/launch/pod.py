"""Run one command on every host of a Cloud TPU VM pod through gcloud, and watch it.

A pod job is "the same command on every host at once" (each host's xmp.spawn
starts one replica per local core). torch_xla's ``xla_dist`` launcher did that
until it was removed with XRT (torch_xla 2.1). ``gcloud ... ssh --worker=all``
can start it too, but it mixes the hosts' output, and when one host fails the
others keep waiting in a collective forever while gcloud waits for them.

So this module starts one ``gcloud compute tpus tpu-vm ssh --worker=I`` per
host, prefixes every output line with its host, and when one host fails it
stops the others and kills the training on every host: exactly the process
groups this launch started, which each host records in ~/.tpustream/runs.
With ``restart`` it relaunches a run that ended by preemption (exit 75: last.pt is saved, and
``resume=auto`` continues from it) or by a lost ssh connection (exit 255).

The functions that build gcloud commands are pure (argv lists, tested without
gcloud); the ones that run them follow. Library code raises TpustreamError;
only ``__main__`` turns errors into exit codes.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tpustream.errors import PREEMPTED_EXIT_CODE, ConfigError, TpustreamError

DEFAULT_WORKDIR = "~/tpustream"
# ssh (so gcloud ssh) exits with 255 when the connection fails or is lost,
# e.g. when a preemptible TPU VM is taken away.
CONNECTION_LOST_EXIT_CODE = 255
RESTARTABLE = {
    PREEMPTED_EXIT_CODE: "preempted; last.pt was saved",
    CONNECTION_LOST_EXIT_CODE: "ssh connection lost",
}
READY = "READY"
# States a TPU VM does not leave by itself: waiting for READY would be forever.
TERMINAL_STATES = {
    "PREEMPTED": "a preemptible or spot TPU VM does not come back: delete it, recreate it "
    "(scripts/create_tpu_pod.sh) and run this command again with --sync; training resumes from last.pt",
    "TERMINATED": "delete it, recreate it (scripts/create_tpu_pod.sh) and run this command again with --sync",
    "STOPPED": "start it (gcloud compute tpus tpu-vm start) and run this command again",
    "STOPPING": "start it (gcloud compute tpus tpu-vm start) and run this command again",
    "DELETING": "it is being deleted",
    "HIDING": "it is being hidden",
    "HIDDEN": "it is hidden",
}
# scripts/create_tpu_pod.sh's start-up script writes this when python3-venv is
# installed; --sync waits for it (at most STARTUP_WAIT_SECONDS) on a new TPU VM.
STARTUP_MARKER = "/var/lib/tpustream/startup-done"
STARTUP_WAIT_SECONDS = 600
# The cleanup sends SIGTERM, then SIGKILL to what is left after this long
# (a replica stuck in a collective may never act on SIGTERM).
CLEANUP_KILL_AFTER_SECONDS = 10
CLEANUP_TIMEOUT_SECONDS = 300  # gcloud alone retries a lost connection for about a minute
DESCRIBE_TIMEOUT_SECONDS = 120
STOP_TIMEOUT_SECONDS = 5
# In the ssh user's home on each host: RUN_ID.WORKER.pid holds the process group
# that worker's training leads. A file is left behind when its training ends by
# itself (nothing runs after the exec that could remove it): a few bytes per
# launch, and harmless, since only a file of the current launch is ever read,
# and only a group carrying its run id is stopped.
RUNS_DIR = ".tpustream/runs"
# Set in the training's environment, so inherited by its replicas and workers: the
# cleanup stops a recorded group only if a process in it carries this launch's id.
RUN_ID_VARIABLE = "TPUSTREAM_RUN_ID"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Not shipped by --sync when the source is not a git checkout.
_SKIP_ANYWHERE = {".git", ".venv", "venv", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache"}
_SKIP_TOP_LEVEL = {"data", "outputs", "multirun", "build", "dist"}


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
        if min(self.grace, self.poll_interval, self.ready_timeout) < 0:
            raise ConfigError("--grace, --poll-interval and --ready-timeout must be >= 0")


def parse_env(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """K=V strings to pairs; a bad name would otherwise become part of the remote command."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE with NAME made of letters, digits and _")
        pairs.append((name, value))
    return tuple(pairs)


# --- gcloud commands (pure) ---------------------------------------------------


def gcloud_tpu(spec: LaunchSpec, verb: str, *args: str) -> list[str]:
    """``gcloud compute tpus tpu-vm VERB ARGS --zone=Z [--project=P]``."""
    project = [f"--project={spec.project}"] if spec.project else []
    return [spec.gcloud, "compute", "tpus", "tpu-vm", verb, *args, f"--zone={spec.zone}", *project]


def describe_command(spec: LaunchSpec) -> list[str]:
    return gcloud_tpu(spec, "describe", spec.tpu, "--format=json")


def ssh_command(spec: LaunchSpec, worker: int | str, remote: str) -> list[str]:
    """Run the shell command ``remote`` on one worker, or on all at once with worker="all".

    gcloud hands ``remote`` to ssh, and sshd to the user's login shell: it is
    parsed by a shell exactly once, on the host.
    """
    return gcloud_tpu(spec, "ssh", spec.tpu, f"--worker={worker}", f"--command={remote}")


def scp_command(spec: LaunchSpec, local: str, remote_path: str) -> list[str]:
    return gcloud_tpu(spec, "scp", local, f"{spec.tpu}:{remote_path}", "--worker=all")


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


def remote_run_command(spec: LaunchSpec, host: int, run_id: str) -> str:
    """``cd WORKDIR && setsid --wait sh -c RECORD tpustream env PJRT_DEVICE=TPU K=V ... COMMAND; exit $?``.

    Overrides such as ``data.train_shards=gs://b/train-{000000..000639}.tar`` or
    ``name='a b'`` must reach train.py as typed, not brace- or glob-expanded:
    every user token is quoted once for the host's shell, and RECORD passes them
    on with ``exec "$@"``. TPUSTREAM_HOST_INDEX tells train.py which host it runs
    on: only host 0 counts shards without recorded sample counts, the others
    wait for its index.

    So that the cleanup stops this training and nothing else, the command leads
    a new process group (setsid) and RECORD writes that group's id, its own pid,
    to ``~/RUNS_DIR/RUN_ID.HOST.pid`` before it execs env and COMMAND: the exec
    chain keeps the pid, so COMMAND itself leads the group and gets the
    cleanup's SIGTERM, and its exit code is the shell's. ``; exit $?`` keeps the
    login shell from exec'ing setsid (bash and dash do that with the last
    command): the login shell leads a group, and setsid called from a group
    leader has to fork. --wait makes a forked setsid still pass the exit code on.
    """
    assignments = [
        ("PJRT_DEVICE", "TPU"),
        ("TPUSTREAM_HOST_INDEX", str(host)),
        *spec.env,
        (RUN_ID_VARIABLE, run_id),  # last: an --env of the same name must not hide the training
    ]
    env = " ".join(shlex.quote(f"{name}={value}") for name, value in assignments)
    record = f'mkdir -p "$HOME/{RUNS_DIR}" && echo $$ > "$HOME/{RUNS_DIR}/{run_id}.{host}.pid" && exec "$@"'
    return (
        f"cd {shell_path(spec.workdir)} && setsid --wait sh -c {shlex.quote(record)} tpustream "
        f"env {env} {shlex.join(spec.command)}; exit $?"
    )


def worker_commands(spec: LaunchSpec, num_workers: int, run_id: str) -> list[list[str]]:
    """One gcloud ssh per worker, so each process's output belongs to one host."""
    return [
        ssh_command(spec, worker, remote_run_command(spec, worker, run_id)) for worker in range(num_workers)
    ]


def preflight_command(spec: LaunchSpec) -> list[str]:
    """One ssh before the concurrent ones: gcloud creates and publishes the SSH key only once."""
    return ssh_command(spec, 0, "true")


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


def cleanup_command(spec: LaunchSpec, run_id: str) -> list[str]:
    return ssh_command(spec, "all", cleanup_script(run_id))


def leftovers_command(spec: LaunchSpec, run_id: str) -> list[str]:
    """List what is left of this launch's training on every host: the processes carrying its run id."""
    marker = shlex.quote(f"{RUN_ID_VARIABLE}={run_id}")
    return ssh_command(
        spec,
        "all",
        f"grep -lxzF {marker} /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | xargs -r ps -o pid=,args= -p",
    )


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
    """Copy the tarball to every host, then unpack and install it there."""
    return [
        scp_command(spec, local_tarball, remote_tarball),
        ssh_command(spec, "all", sync_script(spec, remote_tarball)),
    ]


def new_remote_tarball() -> str:
    """A fresh name per launch: two launches on one TPU must not unpack each other's code."""
    return f"/tmp/tpustream-src-{secrets.token_hex(4)}.tar.gz"


def dry_run_lines(spec: LaunchSpec) -> list[str]:
    """The gcloud commands a launch runs, shell-quoted, one per line; ``#`` lines explain."""
    quote = shlex.join
    shown = spec.num_workers or 1
    lines = ["# dry run: nothing is run"]
    if spec.num_workers is None:
        lines += [
            quote(describe_command(spec)),
            "# describe gives the number of workers (len(networkEndpoints)); worker commands shown for 1",
        ]
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
    lines += [quote(argv) for argv in worker_commands(spec, shown, run_id)]
    lines += [
        "# if a worker fails, the others are stopped and this stops the recorded groups:",
        quote(cleanup_command(spec, run_id)),
    ]
    if spec.restart:
        lines.append(
            f"# --restart: after exit {PREEMPTED_EXIT_CODE} or {CONNECTION_LOST_EXIT_CODE}, describe until "
            f"READY (every {spec.poll_interval:g}s), then all of the above again, at most "
            f"{spec.max_restarts} time(s)"
        )
    return lines


# --- describe -----------------------------------------------------------------


@dataclass(frozen=True)
class TpuInfo:
    state: str
    num_workers: int  # hosts, one per network endpoint


def parse_describe(text: str, tpu: str) -> TpuInfo:
    """The parts of ``describe --format=json`` a launch needs."""
    try:
        node = json.loads(text)
        endpoints = node.get("networkEndpoints") or []
        return TpuInfo(state=str(node.get("state", "UNKNOWN")), num_workers=len(endpoints))
    except (ValueError, AttributeError) as exc:
        raise TpustreamError(f"gcloud describe {tpu}: unexpected output ({exc}): {text[:200]!r}") from None


def describe(spec: LaunchSpec) -> TpuInfo:
    try:
        done = subprocess.run(
            describe_command(spec),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=DESCRIBE_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise TpustreamError(
            f"gcloud describe {spec.tpu}: no answer in {DESCRIBE_TIMEOUT_SECONDS}s"
        ) from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        detail = lines[-1] if lines else f"exit code {done.returncode}"
        raise TpustreamError(f"gcloud describe {spec.tpu} in {spec.zone} failed: {detail}")
    return parse_describe(done.stdout, spec.tpu)


# --- running gcloud -------------------------------------------------------------


class Console:
    """Writes whole lines from several threads; the launcher's own lines start with [launch]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, text: str, *, err: bool = False) -> None:
        stream = sys.stderr if err else sys.stdout
        with self._lock:
            stream.write(text + "\n")
            stream.flush()

    def say(self, message: str) -> None:
        self.line(f"[launch] {message}", err=True)

    def _relay(self, pipe: IO[bytes], prefix: str, err: bool) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                self.line(prefix + raw.decode("utf-8", "replace").rstrip("\r\n"), err=err)

    def follow(self, proc: subprocess.Popen, prefix: str) -> list[threading.Thread]:
        """Relay a process's stdout and stderr, each line prefixed, on two threads."""
        threads = [
            threading.Thread(target=self._relay, args=(proc.stdout, prefix, False), daemon=True),
            threading.Thread(target=self._relay, args=(proc.stderr, prefix, True), daemon=True),
        ]
        for thread in threads:
            thread.start()
        return threads


def require_gcloud(spec: LaunchSpec) -> None:
    if shutil.which(spec.gcloud) is None:
        raise TpustreamError(
            f"{spec.gcloud} not found on PATH: install the Google Cloud CLI "
            "(https://cloud.google.com/sdk/docs/install) and run gcloud auth login"
        )


def start(argv: Sequence[str]) -> subprocess.Popen:
    """Start gcloud in its own process group, so that it and its ssh can be stopped together.

    Its own group also keeps Ctrl-C away from it: the launcher decides what a
    Ctrl-C stops (everything, including the training on the hosts).
    """
    try:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise TpustreamError(f"cannot run {argv[0]}: {exc}") from None


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL if it is still there after STOP_TIMEOUT_SECONDS."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(STOP_TIMEOUT_SECONDS)
            return
        except subprocess.TimeoutExpired:
            continue


def run_streamed(argv: Sequence[str], console: Console, prefix: str, timeout: float | None = None) -> int:
    """Run a command to the end with its output relayed; a timeout stops it (negative code)."""
    proc = start(argv)
    readers = console.follow(proc, prefix)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        console.say(f"no answer after {timeout:g}s: stopping {shlex.join(argv[:5])} ...")
        stop(proc)
    except KeyboardInterrupt:
        stop(proc)
        raise
    finally:
        for reader in readers:
            reader.join(STOP_TIMEOUT_SECONDS)
    return proc.returncode


def _shell_exit_code(code: int) -> int:
    """A Popen return code as a process exit code: killed by signal N -> 128 + N."""
    return 128 - code if code < 0 else code


@dataclass(frozen=True)
class AttemptResult:
    """How one launch on all workers ended."""

    # worker -> gcloud's exit code, for the workers that ended by themselves, in the order they ended
    exits: dict[int, int]
    stopped: tuple[int, ...] = ()  # workers the launcher stopped after another one failed
    interrupted: bool = False  # Ctrl-C

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.stopped and all(code == 0 for code in self.exits.values())

    @property
    def failures(self) -> dict[int, int]:
        """Failed workers in the order they ended; the first is the likely cause."""
        return {worker: code for worker, code in self.exits.items() if code != 0}

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        failures = self.failures
        if failures:
            return _shell_exit_code(next(iter(failures.values())))
        return 1 if self.stopped else 0

    def restart_reason(self) -> str | None:
        """Why relaunching may succeed, or None if the failure is final."""
        if self.interrupted:
            return None
        for worker, code in self.failures.items():
            if code in RESTARTABLE:
                return f"worker {worker} exited with {code} ({RESTARTABLE[code]})"
        return None

    def summary(self) -> str:
        parts = [f"worker {w} exited with {code}" for w, code in self.failures.items()]
        if self.stopped:
            parts.append(f"worker(s) {', '.join(map(str, self.stopped))} stopped by the launcher")
        if self.interrupted:
            parts.insert(0, "interrupted (Ctrl-C)")
        return "; ".join(parts)


def run_workers(spec: LaunchSpec, num_workers: int, run_id: str, console: Console) -> AttemptResult:
    """Run the command on every worker at once and wait for all, or for a failure.

    After the first failure the others get ``spec.grace`` seconds to end by
    themselves (after a preemption each host saves and exits 75 on its own),
    then their gcloud processes are stopped: they would otherwise wait in a
    collective for the failed host forever.
    """
    events: queue.Queue[tuple[int, int]] = queue.Queue()
    procs: dict[int, subprocess.Popen] = {}
    relays: dict[int, list[threading.Thread]] = {}

    def wait(worker: int, proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
        code = proc.wait()
        for reader in readers:
            reader.join(STOP_TIMEOUT_SECONDS)  # its last lines come before the summary
        events.put((worker, code))

    for worker, argv in enumerate(worker_commands(spec, num_workers, run_id)):
        procs[worker] = proc = start(argv)
        relays[worker] = console.follow(proc, f"[worker {worker}] ")
        threading.Thread(target=wait, args=(worker, proc, relays[worker]), daemon=True).start()

    exits: dict[int, int] = {}
    deadline: float | None = None
    interrupted = False
    try:
        while len(exits) < num_workers and (deadline is None or time.monotonic() < deadline):
            try:
                worker, code = events.get(timeout=0.05)
            except queue.Empty:
                continue
            exits[worker] = code
            if code != 0 and deadline is None and len(exits) < num_workers:
                deadline = time.monotonic() + spec.grace
                console.say(
                    f"worker {worker} exited with {code}; the other workers get {spec.grace:g}s to end "
                    "on their own before they are stopped"
                )
    except KeyboardInterrupt:
        interrupted = True
    stopped = []
    for worker, proc in procs.items():
        if worker in exits:
            continue
        stop(proc)
        for reader in relays[worker]:
            reader.join(STOP_TIMEOUT_SECONDS)
        if proc.returncode is not None and proc.returncode >= 0 and not interrupted:
            exits[worker] = proc.returncode  # it ended by itself just before being stopped
        else:
            stopped.append(worker)
    return AttemptResult(exits, tuple(stopped), interrupted)


def cleanup(spec: LaunchSpec, run_id: str, console: Console) -> bool:
    """Stop this launch's training on every host; gcloud ssh ending does not end the remote command."""
    console.say(f"stopping `{' '.join(process_tokens(spec.command))}` of run {run_id} on every worker")
    code = run_streamed(cleanup_command(spec, run_id), console, "[cleanup] ", timeout=CLEANUP_TIMEOUT_SECONDS)
    if code != 0:
        check = leftovers_command(spec, run_id)
        console.say(
            f"the cleanup failed (gcloud exit code {code}): the training may still run on some workers; "
            f"check with: {shlex.join(check)}"
        )
    return code == 0


def wait_until_ready(
    spec: LaunchSpec,
    console: Console,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> TpuInfo:
    """Poll describe until the TPU VM is READY; fail at once in a state it never leaves by itself."""
    deadline = clock() + spec.ready_timeout
    while True:
        try:
            info = describe(spec)
        except TpustreamError as exc:
            if "NOT_FOUND" in str(exc):
                raise TpustreamError(
                    f"TPU {spec.tpu} no longer exists: recreate it (scripts/create_tpu_pod.sh) and run "
                    "this command again with --sync; training resumes from last.pt"
                ) from None
            state = f"unknown ({exc})"  # a network error on this side: keep trying
        else:
            if info.state == READY and info.num_workers:
                return info
            if info.state in TERMINAL_STATES:
                raise TpustreamError(f"TPU {spec.tpu} is {info.state}: {TERMINAL_STATES[info.state]}")
            state = info.state
        if clock() >= deadline:
            raise TpustreamError(f"TPU {spec.tpu} is not READY after {spec.ready_timeout:g}s (state {state})")
        console.say(f"TPU {spec.tpu} is {state}; checking again in {spec.poll_interval:g}s")
        sleep(spec.poll_interval)


# --- --sync ---------------------------------------------------------------------


def find_source_root() -> Path:
    """The checkout tpustream is installed from (editable install: src/tpustream/launch/pod.py)."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "train.py").is_file():
        return root
    raise ConfigError(
        f"--sync copies a tpustream checkout, but tpustream is installed in {root.parent}; "
        "pass --source DIR (the folder with pyproject.toml and train.py)"
    )


def source_files(root: Path) -> list[str]:
    """Paths relative to root that --sync ships: git's tracked files, or a filtered walk without git.

    Tracked files only, so that data, outputs and virtualenvs lying in the
    checkout are not copied to every host.
    """
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True
        ).stdout.decode()
        files = sorted(f for f in listed.split("\0") if f and (root / f).is_file())
    except (OSError, subprocess.CalledProcessError):
        files = _walk_sources(root)
    missing = [name for name in ("pyproject.toml", "train.py") if name not in files]
    if missing:
        raise ConfigError(f"--sync: {root} has no {' and no '.join(missing)}; is it a tpustream checkout?")
    return files


def _walk_sources(root: Path) -> list[str]:
    files = []
    for folder, dirs, names in os.walk(root):
        top = Path(folder) == root
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in _SKIP_ANYWHERE and not d.endswith(".egg-info") and not (top and d in _SKIP_TOP_LEVEL)
        )
        files += [
            (Path(folder) / name).relative_to(root).as_posix() for name in names if not name.endswith(".pyc")
        ]
    return sorted(files)


def build_tarball(root: Path, files: Iterable[str], dest: Path) -> None:
    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(dest, "w:gz") as tar:
        for name in files:
            tar.add(root / name, arcname=name, recursive=False, filter=anonymous)


def sync(spec: LaunchSpec, console: Console) -> None:
    """Copy the code to every host and install it into workdir/.venv there."""
    root = spec.source or find_source_root()
    files = source_files(root)
    with tempfile.TemporaryDirectory(prefix="tpustream-sync-") as tmp:
        tarball = Path(tmp) / "tpustream-src.tar.gz"
        build_tarball(root, files, tarball)
        console.say(
            f"--sync: {len(files)} files of {root} ({tarball.stat().st_size // 1024} KiB) to {spec.workdir} "
            "on every worker, then pip install -e '.[tpu]' there (the first time: torch_xla, minutes)"
        )
        for argv in sync_commands(spec, str(tarball), new_remote_tarball()):
            code = run_streamed(argv, console, "[sync] ")
            if code != 0:
                raise TpustreamError(f"--sync failed: gcloud tpu-vm {argv[4]} exited with {code} (see above)")


def check_ssh(spec: LaunchSpec) -> None:
    """ssh to worker 0 once, attached to the terminal: gcloud may ask about creating a key."""
    code = subprocess.call(preflight_command(spec))
    if code != 0:
        raise TpustreamError(f"cannot ssh to worker 0 of TPU {spec.tpu} (gcloud exit code {code}; see above)")


# --- the launch -------------------------------------------------------------------


def launch_pod(spec: LaunchSpec, sleep: Callable[[float], None] = time.sleep) -> int:
    """Run spec.command on every worker until it succeeds, fails for good or runs out of restarts.

    Returns 0 if every worker exited 0, else the exit code of the first worker
    that failed (130 after Ctrl-C).
    """
    require_gcloud(spec)
    console = Console()
    num_workers = spec.num_workers
    if num_workers is None:
        info = describe(spec)
        if info.state != READY:
            if info.state in TERMINAL_STATES:
                raise TpustreamError(f"TPU {spec.tpu} is {info.state}: {TERMINAL_STATES[info.state]}")
            if not spec.restart:
                raise TpustreamError(f"TPU {spec.tpu} is {info.state}, not READY (--restart waits for READY)")
            info = wait_until_ready(spec, console, sleep)
        if not info.num_workers:
            raise TpustreamError(f"TPU {spec.tpu} is {info.state} but lists no networkEndpoints (hosts)")
        num_workers = info.num_workers
    # One per launch: a restart's commands rewrite the pid files only after the cleanup has read them.
    run_id = new_run_id()
    first = remote_run_command(spec, 0, run_id)
    console.say(f"TPU {spec.tpu}: {num_workers} worker(s), run {run_id}; worker 0 runs: {first}")
    restarts = 0
    while True:
        if spec.sync:
            sync(spec, console)  # again after a restart: a recreated TPU VM has new disks
        else:
            check_ssh(spec)
        result = run_workers(spec, num_workers, run_id, console)
        if result.ok:
            console.say(f"all {num_workers} worker(s) exited with 0")
            return 0
        console.say(result.summary())
        cleaned = cleanup(spec, run_id, console)
        reason = result.restart_reason()
        if reason is None or not spec.restart:
            if reason:
                console.say(f"{reason}: --restart would relaunch the same command (it resumes from last.pt)")
            return result.exit_code
        if restarts >= spec.max_restarts:
            console.say(f"{reason}, but the {spec.max_restarts} restart(s) of --max-restarts are used up")
            return result.exit_code
        restarts += 1
        console.say(
            f"restart {restarts} of {spec.max_restarts}: {reason}; waiting for TPU {spec.tpu} to be READY"
        )
        info = wait_until_ready(spec, console, sleep)
        if spec.num_workers is None:
            num_workers = info.num_workers
        if not cleaned:
            cleanup(spec, run_id, console)  # the hosts may have been unreachable the first time
