"""A replica's progress watchdog: any stall becomes every thread's stacks and an exit a launcher retries.

Equal steps and replicas that fail together cover the hangs tpustream causes.
This covers the ones nobody foresaw: a collective that never completes (the
most reported torch_xla failure, pytorch/xla#8629), a storage call that never
returns, a DataLoader worker stuck in a user's stage, a checkpoint upload that
never finishes. A pod billed by the hour must not sit in one for hours, and
whoever looks at it afterwards must learn where it stopped.

Progress is what tpustream.progress's heartbeat records: a training or
evaluation step finished, a batch received, checkpoint bytes serialised or
written. A thread of the replica's own (``Watchdog``) looks at it about every
second, against the allowance in force (``allowances``):
- ``watchdog.seconds``, or ``auto``: AUTO_STEP_MULTIPLE times the median
  interval between this process's training steps, at least AUTO_FLOOR_SECONDS
  (the floor alone until AUTO_MIN_STEPS intervals are known);
- ``watchdog.first_step_seconds`` while the process compiles: from its start
  until its first steps have finished, and again around its first evaluation,
  epoch end and save (the first compile of a large model can take tens of
  minutes), but not while its training thread waits for a batch: a graph is
  compiled when the step before the wait is cut, so a stuck input is found as
  soon as in any other step;
- ``watchdog.stop_grace_seconds`` once a stop was requested (SIGTERM), unless
  it compiles: a replica that cannot reach the step boundary where it would
  save (its input is stuck) must still exit 75 before the host's kill (about
  30 s on a preempted TPU VM). last.pt keeps the last save that finished.

When one is spent (``Watchdog.fire``), the replica writes the Python stacks of
every thread of its process and of its DataLoader workers (watchdog.stacks) to
``<output_dir>/watchdog/replica-R-TIME.txt``, logs one line naming where each
thread is and what was last finished, leaves a report in the host's reports
folder (watchdog.reports), waits a moment for the other replicas of this host
to leave theirs (they watch the folder and fire too: a hang is the whole
host's), and exits: HUNG_EXIT_CODE (76), or 75 for a stop request it could not
honour. train.py then exits with the same code (``Reports.raise_verdict``).

A thread that holds Python's lock forever would keep the watchdog's own thread
from running: faulthandler's C timer (``dump_traceback_later``), pushed back
at every check, is the backstop; its dump is a file in the reports folder that
train.py copies to the run folder before it exits 76.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpustream import preemption
from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from tpustream.progress import HEARTBEAT, Heartbeat
from tpustream.watchdog.reports import REMOTE_WRITE_SECONDS, Hung, Reports, write_stacks
from tpustream.watchdog.stacks import (
    ThreadStack,
    dump_workers,
    enable_worker_dumps,
    thread_stacks,
    watch_workers,
    worker_where,
)

log = logging.getLogger(__name__)

# auto: this many median training steps without progress, and never under the floor
# (an epoch's end evaluates, gathers and saves). The floor stays under the 10 minutes
# after which a gloo or NCCL collective gives up (launch.spawn's process groups), so a
# hung collective is reported here, with stacks and a retried exit, for steps under 30 s.
AUTO_STEP_MULTIPLE = 20
AUTO_FLOOR_SECONDS = 300.0
# Step intervals auto waits for before it trusts their median.
AUTO_MIN_STEPS = 5
# The longest gap between two checks.
MAX_CHECK_SECONDS = 1.0
# Seconds the firing replica waits for this host's other replicas to report.
SIBLING_WAIT_SECONDS = 5.0
# After a stop request the stacks' remote write gets less: the host's kill comes at about 30 s.
REMOTE_WRITE_AFTER_STOP_SECONDS = 5.0
# Firing never takes longer than this: past it the process exits as it is.
FIRE_BOUND_SECONDS = 60.0
# faulthandler's backstop fires this long after the watchdog should have.
BACKSTOP_MARGIN_SECONDS = 30.0
# Threads of ours that only wait, left out of the one-line summary (not the file).
QUIET_THREADS = {"progress-watchdog", "parent-watchdog", "stop-forwarder", "watchdog-write", "watchdog-exit"}

__all__ = [
    "Hung",
    "Limits",
    "Reports",
    "Watchdog",
    "enable_worker_dumps",
    "start_watchdog",
    "stop_watchdog",
    "watch_workers",
    "worker_dumps_folder",
]


@dataclass(frozen=True)
class Limits:
    """watchdog.* as numbers: steady None = auto; enabled False = watchdog.seconds=0."""

    steady: float | None
    first_step: float
    stop_grace: float
    enabled: bool

    @classmethod
    def from_config(cls, cfg: Any) -> Limits:
        auto = cfg.seconds == "auto"
        return cls(
            steady=None if auto else float(cfg.seconds),
            first_step=float(cfg.first_step_seconds),
            stop_grace=float(cfg.stop_grace_seconds),
            enabled=auto or float(cfg.seconds) > 0,
        )


@dataclass(frozen=True)
class Allowance:
    seconds: float
    why: str  # how it was reached, for the log line and the stacks file
    exit_code: int


@dataclass(frozen=True)
class Verdict:
    """Why a watchdog fires: the allowance spent, how long nothing moved, and the exit it leads to."""

    allowance: Allowance
    idle_seconds: float
    what: str  # the last progress
    finished: str  # the last training step finished
    sibling: str | None = None  # another replica of this host fired first ("replica N")

    @property
    def exit_code(self) -> int:
        return self.allowance.exit_code

    def headline(self) -> str:
        last = f"last progress {self.idle_seconds:.0f} s ago: {self.what}; last finished: {self.finished}"
        if self.sibling is not None:
            return f"{self.sibling} of this host fired first; {last}"
        if self.exit_code == PREEMPTED_EXIT_CODE:
            return f"the step did not finish after the stop request (allowed {self.allowance.why}); {last}"
        return f"nothing progressed (allowed {self.allowance.why}); {last}"


def median_step(heartbeat: Heartbeat) -> float | None:
    intervals = list(heartbeat.step_intervals)
    return statistics.median(intervals) if len(intervals) >= AUTO_MIN_STEPS else None


def allowances(limits: Limits, heartbeat: Heartbeat, stopped: bool) -> list[Allowance]:
    """The allowances in force now ([]: unwatched); the first one spent fires.

    A stop request's counts from the later of the request and the last
    progress; the others from the last progress.
    """
    found: list[Allowance] = []
    compiling = heartbeat.compiling is not None and not heartbeat.waiting_for_input
    # A compile's progress cannot be seen: a stop during one waits for it (or for the host's kill).
    if stopped and limits.stop_grace > 0 and not compiling:
        why = f"{limits.stop_grace:g} s after a stop request"
        found.append(Allowance(limits.stop_grace, why, PREEMPTED_EXIT_CODE))
    if not limits.enabled:
        return found
    if compiling:
        why = f"{limits.first_step:g} s while compiling {heartbeat.compiling}"
        found.append(Allowance(limits.first_step, why, HUNG_EXIT_CODE))
    elif limits.steady is not None:
        found.append(Allowance(limits.steady, f"{limits.steady:g} s", HUNG_EXIT_CODE))
    else:
        median = median_step(heartbeat)
        seconds = AUTO_FLOOR_SECONDS
        if median is not None:
            seconds = max(seconds, AUTO_STEP_MULTIPLE * median)
        if seconds == AUTO_FLOOR_SECONDS:
            why = f"auto: {seconds:.0f} s, the floor"
        else:
            why = f"auto: {seconds:.0f} s, {AUTO_STEP_MULTIPLE} x the median step of {median:.2f} s"
        found.append(Allowance(seconds, why, HUNG_EXIT_CODE))
    return found


class Watchdog:
    """One per replica process: checks the heartbeat on a thread of its own and fires when it stops.

    on_fire: what firing does (default ``fire``: stacks, report, exit); tests
    give their own, and their own stop_requested (default: this process's
    stop flag). backstop: arm faulthandler's C timer behind it (one timer per
    process: not in a test process that has its own).
    """

    def __init__(
        self,
        limits: Limits,
        rank: int,
        output_dir: str,
        log_dir: str | None = None,
        reports: Reports | None = None,
        local_replicas: int = 1,
        heartbeat: Heartbeat = HEARTBEAT,
        on_fire: Callable[[Verdict], None] | None = None,
        backstop: bool = False,
        stop_requested: Callable[[], bool] | None = None,
    ):
        self.limits = limits
        self.rank = rank
        self.output_dir = output_dir
        self.log_dir = log_dir
        self.reports = reports
        self.local_replicas = local_replicas
        self.heartbeat = heartbeat
        self.on_fire = on_fire or self.fire
        self.backstop = backstop
        self.stop_requested = stop_requested or (lambda: preemption.stop_requested())
        self.fired: Verdict | None = None
        self._stop_seen: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_file = None
        self._training_thread: int | None = None  # the thread that started it: listed first

    @property
    def active(self) -> bool:
        return self.limits.enabled or self.limits.stop_grace > 0

    def worker_dumps_folder(self) -> str | None:
        """Where this replica's DataLoader workers write their stacks (None: nobody will ask)."""
        if not self.active or self.reports is None:
            return None
        return self.reports.workers_folder(self.rank)

    def start(self) -> Watchdog:
        if not self.active:
            return self
        self._training_thread = threading.get_ident()
        if self.backstop and self.reports is not None:
            self._backstop_file = open(self.reports.backstop_path(self.rank), "w")  # noqa: SIM115
        self._thread = threading.Thread(target=self._watch, name="progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The replica is done: stop watching (its exit path is the process's own)."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._backstop_file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_file.close()
            with contextlib.suppress(OSError):
                os.remove(self._backstop_file.name)
            self._backstop_file = None

    def verdict(self, now: float) -> Verdict | None:
        """Whether the replica is to be called hung (or stuck after a stop request) at `now` (monotonic)."""
        heartbeat = self.heartbeat
        if self._stop_seen is None and self.stop_requested():
            self._stop_seen = now
        last = heartbeat.at
        for current in allowances(self.limits, heartbeat, self._stop_seen is not None):
            since = max(self._stop_seen, last) if current.exit_code == PREEMPTED_EXIT_CODE else last
            if now - since > current.seconds:
                return Verdict(current, now - last, heartbeat.what, heartbeat.last_finished())
        return None

    def sibling_verdict(self, now: float) -> Verdict | None:
        """Another replica of this host fired: fire too, with its exit code."""
        if self.reports is None:
            return None
        others = {rank: report for rank, report in self.reports.read().items() if rank != self.rank}
        if not others:
            return None
        rank, report = min(others.items())
        return Verdict(
            Allowance(0.0, f"replica {rank} fired", report["exit_code"]),
            now - self.heartbeat.at,
            self.heartbeat.what,
            self.heartbeat.last_finished(),
            sibling=f"replica {rank}",
        )

    def _watch(self) -> None:
        while not self._done.is_set():
            now = time.monotonic()
            found = self.verdict(now) or self.sibling_verdict(now)
            if found is not None:
                self.fired = found
                self.on_fire(found)
                return
            interval = self._check_interval()
            self._push_back_backstop(now, interval)
            self._done.wait(interval)

    def _check_interval(self) -> float:
        current = allowances(self.limits, self.heartbeat, self._stop_seen is not None)
        shortest = min((option.seconds for option in current), default=10 * MAX_CHECK_SECONDS)
        return max(min(MAX_CHECK_SECONDS, shortest / 10), 0.01)

    def _push_back_backstop(self, now: float, interval: float) -> None:
        """faulthandler's timer to just after this watchdog would have fired, had its thread run."""
        if self._backstop_file is None:
            return
        current = allowances(self.limits, self.heartbeat, self._stop_seen is not None)
        soonest_left = min((option.seconds - (now - self.heartbeat.at) for option in current), default=0.0)
        seconds = max(soonest_left, 0.0) + interval + FIRE_BOUND_SECONDS + BACKSTOP_MARGIN_SECONDS
        faulthandler.dump_traceback_later(seconds, repeat=False, file=self._backstop_file, exit=True)

    # -- firing ---------------------------------------------------------------

    def describe(self, verdict: Verdict) -> tuple[str, str]:
        """(the stacks file's text, the one line naming where each thread is)."""
        own = thread_stacks(first=self._training_thread, skip=threading.get_ident())
        folder = self.worker_dumps_folder()
        workers = [] if folder is None else dump_workers(folder)
        # The line names threads in code of ours or a library's; those only in the standard
        # library (queue feeders) are in the file.
        places = [
            f"{self._thread_label(stack)}: {stack.where}"
            for stack in own
            if stack.name not in QUIET_THREADS and stack.outside_standard_library
        ]
        places += [f"DataLoader worker pid {pid}: {worker_where(text)}" for pid, text in workers]
        header = [
            f"tpustream watchdog: replica {self.rank} (pid {os.getpid()}, host {socket.gethostname()}), "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            verdict.headline(),
            f"exit code {verdict.exit_code}",
            "",
        ]
        sections = [f"== {self._thread_label(stack)}: {stack.where}\n{stack.text}" for stack in own]
        sections += [
            f"== DataLoader worker pid {pid} (faulthandler, most recent call first)\n{text}\n"
            for pid, text in workers
        ]
        return "\n".join(header + sections), "; ".join(places)

    def _thread_label(self, stack: ThreadStack) -> str:
        if stack.ident == self._training_thread:
            return f"training thread ({stack.name})"
        return f"thread {stack.name}"

    def fire(self, verdict: Verdict) -> None:
        """Write the stacks, log the line, report to train.py, and exit with the verdict's code."""
        code = verdict.exit_code
        # Whatever below blocks (a logging lock a stuck thread holds, a storage
        # call), the process exits within the bound.
        exit_later = threading.Thread(
            target=_exit_after, args=(FIRE_BOUND_SECONDS, code), name="watchdog-exit", daemon=True
        )
        exit_later.start()
        if self._backstop_file is not None:
            faulthandler.cancel_dump_traceback_later()
        text, places = self.describe(verdict)
        bound = REMOTE_WRITE_AFTER_STOP_SECONDS if code == PREEMPTED_EXIT_CODE else REMOTE_WRITE_SECONDS
        where = write_stacks(self.output_dir, self.log_dir, self.rank, text, bound)
        headline = verdict.headline()
        log.error("watchdog: %s; stacks in %s; threads: %s; exiting %d", headline, where, places, code)
        if self.reports is not None:
            with contextlib.suppress(OSError):
                self.reports.write(self.rank, {"exit_code": code, "headline": headline, "stacks": where})
            self._wait_for_siblings()
        logging.shutdown()
        os._exit(code)

    def _wait_for_siblings(self) -> None:
        """Give this host's other replicas a moment to write their stacks before train.py ends them."""
        if self.local_replicas <= 1 or self.reports is None:
            return
        deadline = time.monotonic() + SIBLING_WAIT_SECONDS
        while time.monotonic() < deadline and len(self.reports.read()) < self.local_replicas:
            time.sleep(0.1)


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


# The watchdog of this process (replicas that are threads of one process share
# it, as they share the heartbeat).
_current: Watchdog | None = None
_current_lock = threading.Lock()


def start_watchdog(watchdog: Watchdog) -> Watchdog:
    """Start `watchdog` as this process's, unless one runs already (then that one)."""
    global _current
    with _current_lock:
        if _current is None:
            watchdog.heartbeat.reset()
            _current = watchdog.start()
        return _current


def stop_watchdog(watchdog: Watchdog) -> None:
    global _current
    with _current_lock:
        if _current is watchdog:
            watchdog.stop()
            _current = None


def worker_dumps_folder() -> str | None:
    """Where this process's DataLoader workers write their stacks, if a watchdog runs here."""
    current = _current
    return None if current is None else current.worker_dumps_folder()
