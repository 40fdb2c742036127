"""Run the command on every worker and watch it: stop all on a failure or Ctrl-C, relaunch after preemption.

One ``gcloud compute tpus tpu-vm ssh --worker=I`` per host, each output line
prefixed with its host; when one host fails the others are stopped and the
training is killed on every host (exactly the process groups this launch
started). With ``restart`` a run that ended by preemption (exit 75: last.pt is
saved, and ``resume=auto`` continues from it), by a hang (exit 76: a replica's
watchdog saw no progress and wrote the stacks to output_dir/watchdog/) or by a
lost ssh connection (exit 255) is relaunched once the TPU VM is READY again.

Every relaunch, whatever its cause, counts against ``max_restarts``: a hang
that comes back at the same place is not cured by restarting, and a pod is
relaunched once per attempt however many of its hosts failed (when one host
hangs, the others wait in a collective until their own watchdogs fire too).
"""

from __future__ import annotations

import queue
import shlex
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE, TpustreamError
from tpustream.pod import interrupts
from tpustream.pod.commands import (
    CONNECTION_LOST_EXIT_CODE,
    Worker,
    cleanup_commands,
    launch_workers,
    leftovers_commands,
    new_run_id,
    preflight_command,
    process_tokens,
    remote_run_command,
    worker_commands,
)
from tpustream.pod.processes import STOP_TIMEOUT_SECONDS, Console, require_gcloud, run_streamed, start, stop
from tpustream.pod.recreate import PodKeeper
from tpustream.pod.spec import LaunchSpec, command_output_dir, is_bucket_url
from tpustream.pod.sync import sync
from tpustream.pod.tpu import TpuInfo

RESTARTABLE = {
    PREEMPTED_EXIT_CODE: "preempted; last.pt was saved",
    HUNG_EXIT_CODE: "hung",  # said with where the stacks are: see restart_reason
    CONNECTION_LOST_EXIT_CODE: "ssh connection lost",
}
# What the give-up line counts the restarts after, one and several.
RESTART_CAUSES = {
    PREEMPTED_EXIT_CODE: ("a preemption", "preemptions"),
    HUNG_EXIT_CODE: ("a hang", "hangs"),
    CONNECTION_LOST_EXIT_CODE: ("a lost connection", "lost connections"),
}
CLEANUP_TIMEOUT_SECONDS = 300  # gcloud alone retries a lost connection for about a minute


def _shell_exit_code(code: int) -> int:
    """A Popen return code as a process exit code: killed by signal N -> 128 + N."""
    return 128 - code if code < 0 else code


@dataclass(frozen=True)
class AttemptResult:
    """How one launch on all workers ended."""

    # worker -> gcloud's exit code, for the workers that ended by themselves, in the order they ended
    exits: dict[Worker, int]
    stopped: tuple[Worker, ...] = ()  # workers the launcher stopped after another one failed
    interrupted: bool = False  # Ctrl-C

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.stopped and all(code == 0 for code in self.exits.values())

    @property
    def failures(self) -> dict[Worker, int]:
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

    def restart_cause(self) -> tuple[Worker, int] | None:
        """(worker, exit code) of the first failure a relaunch may cure, or None if the failure is final."""
        if self.interrupted:
            return None
        return next(((w, code) for w, code in self.failures.items() if code in RESTARTABLE), None)

    def restart_reason(self, spec: LaunchSpec) -> str | None:
        """Why relaunching may succeed, as one clause, or None if the failure is final."""
        cause = self.restart_cause()
        if cause is None:
            return None
        worker, code = cause
        if code == HUNG_EXIT_CODE:
            return f"{worker} hung (exit {code}; stacks in {stacks_location(spec)})"
        return f"{worker} exited with {code} ({RESTARTABLE[code]})"

    def summary(self) -> str:
        parts = [f"{w} exited with {code}" for w, code in self.failures.items()]
        if self.stopped:
            if any(w.slices > 1 for w in self.stopped):
                stopped = ", ".join(map(str, self.stopped))
            else:
                stopped = "worker(s) " + ", ".join(str(w.host) for w in self.stopped)
            parts.append(f"{stopped} stopped by the launcher")
        if self.interrupted:
            parts.insert(0, "interrupted (Ctrl-C)")
        return "; ".join(parts)


def stacks_location(spec: LaunchSpec) -> str:
    """Where a hung run's watchdog wrote the stacks: output_dir/watchdog/, on the hosts unless in a bucket."""
    output_dir = command_output_dir(spec.command)
    if output_dir is None:
        return f"output_dir/watchdog/ on the hosts (the run's folder under {spec.workdir}/outputs/)"
    where = f"{output_dir.rstrip('/')}/watchdog/"
    return where if is_bucket_url(output_dir) else f"{where} on the hosts"


def restarts_used(causes: Counter[int]) -> str:
    """e.g. '2 after hangs, 1 after a preemption'."""
    parts = []
    for code, count in causes.most_common():
        one, several = RESTART_CAUSES[code]
        parts.append(f"{count} after {one if count == 1 else several}")
    return ", ".join(parts)


def run_workers(
    spec: LaunchSpec, workers: list[Worker], run_id: str, console: Console, coordinator: str | None = None
) -> AttemptResult:
    """Run the command on every worker at once and wait for all, or for a failure or a Ctrl-C.

    After the first failure the others get ``spec.grace`` seconds to end by
    themselves (after a preemption each host saves and exits 75 on its own),
    then their gcloud processes are stopped: they would otherwise wait in a
    collective for the failed host forever. A Ctrl-C stops them at once. From
    the first start to the last stop it is polled, not raised (interrupts.deferred),
    so every gcloud started is stopped whenever it comes.
    """
    events: queue.Queue[tuple[Worker, int]] = queue.Queue()
    procs: dict[Worker, subprocess.Popen] = {}
    relays: dict[Worker, list[threading.Thread]] = {}

    def wait(worker: Worker, proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
        code = proc.wait()
        for reader in readers:
            reader.join(STOP_TIMEOUT_SECONDS)  # its last lines come before the summary
        events.put((worker, code))

    exits: dict[Worker, int] = {}
    stopped: list[Worker] = []
    interrupted = False
    with interrupts.deferred():
        try:
            commands = worker_commands(spec, workers, run_id, coordinator)
            for worker, argv in zip(workers, commands, strict=True):
                if interrupts.received():
                    break  # no training starts on the other hosts
                procs[worker] = proc = start(argv)
                relays[worker] = console.follow(proc, f"[{worker}] ")
                threading.Thread(target=wait, args=(worker, proc, relays[worker]), daemon=True).start()
            deadline: float | None = None
            while (
                len(exits) < len(workers)
                and not interrupts.received()
                and (deadline is None or time.monotonic() < deadline)
            ):
                try:
                    worker, code = events.get(timeout=0.05)
                except queue.Empty:
                    continue
                exits[worker] = code
                if code != 0 and deadline is None and len(exits) < len(workers):
                    deadline = time.monotonic() + spec.grace
                    console.say(
                        f"{worker} exited with {code}; the other workers get {spec.grace:g}s to "
                        "end on their own before they are stopped"
                    )
        except KeyboardInterrupt:  # SIGINT left to Python: launch_pod called outside main()
            interrupted = True
        finally:  # also when a start fails: the workers started before it are stopped
            interrupted = interrupted or interrupts.received()
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
        interrupted = interrupted or interrupts.received()  # also one that came while stopping
    return AttemptResult(exits, tuple(stopped), interrupted)


def cleanup(spec: LaunchSpec, run_id: str, console: Console) -> bool:
    """Stop this launch's training on every host; gcloud ssh ending does not end the remote command."""
    console.say(f"stopping `{' '.join(process_tokens(spec.command))}` of run {run_id} on every worker")
    codes = [
        run_streamed(argv, console, "[cleanup] ", timeout=CLEANUP_TIMEOUT_SECONDS)
        for argv in cleanup_commands(spec, run_id)
    ]
    failed = [(node, code) for node, code in zip(spec.nodes, codes, strict=True) if code != 0]
    if failed:
        check = " ; ".join(shlex.join(argv) for argv in leftovers_commands(spec, run_id))
        where = f" of {', '.join(node for node, _ in failed)}" if spec.num_slices > 1 else ""
        console.say(
            f"the cleanup failed (gcloud exit code {failed[0][1]}): the training may still run on some "
            f"workers{where}; check with: {check}"
        )
    return not failed


def check_ssh(spec: LaunchSpec) -> None:
    """ssh to worker 0 once, attached to the terminal: gcloud may ask about creating a key."""
    code = subprocess.call(preflight_command(spec))
    if code != 0:
        raise TpustreamError(
            f"cannot ssh to worker 0 of TPU {spec.nodes[0]} (gcloud exit code {code}; see above)"
        )


def launch_pod(spec: LaunchSpec, sleep: Callable[[float], None] = time.sleep) -> int:
    """Run spec.command on every worker until it succeeds, fails for good or runs out of restarts.

    Returns 0 if every worker exited 0, else the exit code of the first worker
    that failed (130 after Ctrl-C: see interrupts for how it is never lost).
    """
    require_gcloud(spec)
    console = Console()
    pod = PodKeeper(spec, console, sleep)
    try:
        return _launch(spec, pod, console)
    finally:
        pod.farewell()


def hosts_of(spec: LaunchSpec, info: TpuInfo | None) -> tuple[list[Worker], str | None]:
    """The launch's workers (--num-workers, else the pod's hosts) and the coordinator of several slices."""
    num_workers = spec.num_workers
    if num_workers is None or spec.num_slices > 1:
        if not info or not info.num_workers or (spec.num_slices > 1 and not info.address):
            state = info.state if info else "UNKNOWN"
            raise TpustreamError(f"TPU {spec.tpu} is {state} but lists no networkEndpoints (hosts)")
        num_workers = num_workers or info.num_workers
    coordinator = info.address if info is not None and spec.num_slices > 1 else None
    return launch_workers(spec, num_workers), coordinator


def _launch(spec: LaunchSpec, pod: PodKeeper, console: Console) -> int:
    workers, coordinator = hosts_of(spec, pod.first())
    # One per launch: a restart's commands rewrite the pid files only after the cleanup has read them.
    run_id = new_run_id()
    first = remote_run_command(spec, workers[0], run_id, coordinator)
    slices = f" ({spec.num_slices} slices, coordinator {coordinator})" if spec.num_slices > 1 else ""
    console.say(f"TPU {spec.tpu}: {len(workers)} worker(s){slices}, run {run_id}; {workers[0]} runs: {first}")
    restarts: Counter[int] = Counter()  # by the exit code that caused them
    while True:
        if spec.sync:
            sync(spec, console)  # again after a restart: a recreated TPU VM has new disks
        else:
            check_ssh(spec)
        # From the first start to the end of the cleanup, the first Ctrl-C is only recorded:
        # the workers are stopped and cleaned up after, as after a failure; a second one
        # abandons the cleanup. One that comes as the workers end still counts (exit 130).
        with interrupts.deferred(up_to=1):
            result = run_workers(spec, workers, run_id, console, coordinator)
            if interrupts.received():
                result = replace(result, interrupted=True)
            if result.ok:
                console.say(f"all {len(workers)} worker(s) exited with 0")
                return 0
            console.say(result.summary())
            cleaned = cleanup(spec, run_id, console)
        if interrupts.received():  # during the cleanup, which it let finish
            result = replace(result, interrupted=True)
        # One cause per attempt, however many hosts failed: a hang on one host makes the
        # others' watchdogs fire too, and all of them are one relaunch.
        cause, reason = result.restart_cause(), result.restart_reason(spec)
        if cause is None or not spec.restart:
            if reason:
                console.say(f"{reason}: --restart would relaunch the same command (it resumes from last.pt)")
            return result.exit_code
        used = restarts.total()
        if used >= spec.max_restarts:
            spent = f" ({restarts_used(restarts)})" if used else ""
            limit = f"the {spec.max_restarts} restart(s) of --max-restarts"
            console.say(f"{reason}; {limit} are used up{spent}: giving up")
            return result.exit_code
        restarts[cause[1]] += 1
        console.say(
            f"restart {used + 1} of {spec.max_restarts}: {reason}; waiting for TPU {spec.tpu} to be READY"
        )
        workers, coordinator = hosts_of(spec, pod.ready())  # a recreated pod may have other hosts
        if not cleaned and not pod.fresh:
            cleanup(spec, run_id, console)  # the hosts may have been unreachable the first time
