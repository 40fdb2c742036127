"""Stop requests: SIGTERM (what a TPU VM gets about 30 s before it is taken) becomes a flag.

Python lets only a process's main thread install signal handlers, and under
PJRT a v2/v3 host runs replicas as threads of a process whose main thread
belongs to torch_xla's spawn machinery. So every process installs the
handler from its main thread when it starts (train.py does it for the
processes xmp.spawn and the simulated pod start, which import it as their
main module), the handler only sets a process-wide flag, and the trainer's
replicas agree on that flag at a step boundary, save last.pt, and stop.

The flag is process-wide on purpose: a signal is delivered to a process, and
every replica thread of that process must see it.

SIGINT (Ctrl-C) is a stop request too, and a process that gets either signal
passes SIGTERM on to the processes it started: ``docker stop`` and Kubernetes
signal only the container's first process (train.py), whose replicas would
otherwise never hear of it and be killed outright when the grace period ends.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

from tpustream.errors import PREEMPTED_EXIT_CODE

log = logging.getLogger(__name__)

_requested = threading.Event()
# The signals that asked this process to stop, first first (process-wide, as the flag).
_received: list[int] = []
# Set while this process starts its replicas: the forwarder keeps going though none is up yet.
_starting_children = threading.Event()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exit code of a Ctrl-C that stopped a run before anything was trained (128 + SIGINT, as shells use).
INTERRUPTED_EXIT_CODE = 130


class Preempted(Exception):
    """Raised by the trainer after it saved its progress because a stop was requested."""

    exit_code = PREEMPTED_EXIT_CODE


class StoppedBeforeStart(Preempted):
    """A stop was requested before the replicas started: nothing was trained, nothing to save.

    Exit 75 for SIGTERM (a launcher may start the run again), 130 for Ctrl-C
    (the user stopped it; nothing to continue).
    """

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if _received[:1] == [signal.SIGINT] else PREEMPTED_EXIT_CODE


def raise_if_stop_requested(where: str) -> None:
    """Before the replicas start: end the run here if a stop was requested (StoppedBeforeStart)."""
    if _requested.is_set():
        names = "/".join(dict.fromkeys(signal.Signals(s).name for s in _received)) or "a stop request"
        raise StoppedBeforeStart(f"{names} {where}; nothing was trained")


@contextlib.contextmanager
def starting_replicas():
    """Around starting this process's replicas and waiting for them.

    A stop requested before is final here (StoppedBeforeStart); one that
    comes while they start reaches them: the forwarder goes on sending it
    until they are up and gone, instead of giving up when it finds none yet.
    """
    raise_if_stop_requested("before the replicas started")
    _starting_children.set()
    try:
        yield
    finally:
        _starting_children.clear()


def _on_signal(signum: int, frame) -> None:
    _received.append(signum)
    if not _requested.is_set():
        _requested.set()
        # Logging from a signal handler is safe enough here: the handler runs
        # between bytecodes of the main thread, not inside a C call.
        log.warning(
            "received %s: finishing the current step, saving last.pt, then stopping",
            signal.Signals(signum).name,
        )
    forward_stop_to_children()


def forward_stop_to_children() -> None:
    """SIGTERM to the replicas this process started (not its DataLoader workers).

    Then again every FORWARD_AGAIN_SECONDS while they live, from a thread: a
    child still starting (before its handler is installed) or one that missed
    the signal would otherwise be killed outright when the grace period ends.
    """
    _signal_children()
    global _forwarder
    if _forwarder is None or not _forwarder.is_alive():
        _forwarder = threading.Thread(target=_keep_forwarding, name="stop-forwarder", daemon=True)
        _forwarder.start()


FORWARD_AGAIN_SECONDS = 1.0
_forwarder: threading.Thread | None = None  # one per process: the stop flag is process-wide too


def _signal_children() -> bool:
    """SIGTERM to this process's live children but daemons; False if there are none.

    Daemons are DataLoader workers (torch starts them so): they ignore stop
    signals by design and their loader shuts them down; signalled, a loader
    that lives on (one a test keeps) would keep the forwarder going forever.
    Replicas (xmp.spawn's pool, torch.multiprocessing) are not daemons.
    """
    children = [child for child in multiprocessing.active_children() if not child.daemon]
    for child in children:
        with contextlib.suppress(ProcessLookupError, TypeError):  # gone, or not started yet (pid None)
            os.kill(child.pid, signal.SIGTERM)
    return bool(children)


def _keep_forwarding() -> None:
    while True:
        time.sleep(FORWARD_AGAIN_SECONDS)
        if not _signal_children() and not _starting_children.is_set():
            return


@contextlib.contextmanager
def stop_signals_blocked():
    """Block stop signals on this thread while it starts a helper process (any thread).

    A blocked signal mask survives fork and exec, so the child starts immune
    from its first instruction: a stop signal sent to the process group
    before the child ignores it (a fresh Python takes 50-100 ms to get there)
    waits, pending, and ignoring it discards it (``ignore_stop_signals``).
    Without it, a Ctrl-C as the DataLoader workers' fork server started
    killed the server and failed the replica instead of saving. Only this
    thread's mask changes: the process's other threads still receive the
    signal, and on a thread that is alone the signal waits until the block
    ends, lost never. (SIG_IGN would need the main thread, which a replica
    running as a thread under xmp.spawn is not.)
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals(keep_blocked: bool = False) -> None:
    """In a helper process (DataLoader worker): ignore stop signals; its replica decides when to stop.

    Then unblock them (a helper started under ``stop_signals_blocked``): a
    signal that arrived while blocked is discarded by the ignore. A fork
    server keeps them blocked: its forks then start blocked (a fork keeps
    the mask, not the pending signals) and stay immune until their own
    ``ignore_stop_signals``, whatever they install before (torch's worker
    loop installs a SIGTERM handler that dies unless the signal came from
    the worker's parent, and a replica forwards SIGTERM to its workers).
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK if keep_blocked else signal.SIG_UNBLOCK, STOP_SIGNALS)


def install_stop_handlers() -> bool:
    """Turn SIGTERM into a stop request in this process; False if not on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    return True


def stop_requested() -> bool:
    return _requested.is_set()


def request_stop() -> None:
    """Ask this process's replicas to save and stop (as SIGTERM does)."""
    _requested.set()


def _zombie(pid: int) -> bool:
    """Whether pid has died and waits for its parent to reap it (a signal still reaches a zombie).

    A killed replica stays a zombie until train.py collects it, and a parent
    that waits for its child's output first never does while the workers
    hold that output open. Linux's /proc; elsewhere, never a zombie.
    """
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def exit_with_parent(poll_seconds: float = 0.5, parent: int | None = None) -> None:
    """Stop this process if the process that started it (or `parent`) dies.

    A replica is the child of train.py (xmp.spawn, or the simulated pod). If
    train.py is killed outright (SIGKILL, OOM), nothing tells its children;
    they would live on as orphans, some of them waiting in a collective
    forever. DataLoader workers have a watchdog of torch's, but it takes the
    parent pid when the worker is up: a replica that dies while its workers
    import torch leaves them looping forever; they get this one too.
    """
    import os

    # Polled, not PR_SET_PDEATHSIG: that signal follows the parent *thread*
    # that forked, and xmp.spawn's pool forks from a thread that may end first.
    # A getppid() every half second costs nothing, and a replica that holds
    # accelerators lets go of them within a second of train.py's death (a
    # replica and then its workers: two polls).
    # A child that starts slowly may find its parent already gone and adopted
    # by init; so callers that know the parent's pid pass it instead of
    # trusting getppid() at start. A DataLoader worker's parent is the
    # replica's fork server, not the replica: it watches the replica itself.
    parent = os.getppid() if parent is None else parent
    if os.getppid() == parent:

        def alive() -> bool:
            return os.getppid() == parent
    else:

        def alive() -> bool:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                return False
            except PermissionError:  # alive, another user's (a reused pid): count as alive
                return True
            return not _zombie(parent)

    if not alive():
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if not alive():
                log.error("the process that started this one (pid %d) is gone; stopping", parent)
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
