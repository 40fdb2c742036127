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
"""

from __future__ import annotations

import logging
import signal
import threading

from tpustream.errors import PREEMPTED_EXIT_CODE

log = logging.getLogger(__name__)

_requested = threading.Event()
STOP_SIGNALS = (signal.SIGTERM,)


class Preempted(Exception):
    """Raised by the trainer after it saved its progress because a stop was requested."""

    exit_code = PREEMPTED_EXIT_CODE


def _on_signal(signum: int, frame) -> None:
    if not _requested.is_set():
        _requested.set()
        # Logging from a signal handler is safe enough here: the handler runs
        # between bytecodes of the main thread, not inside a C call.
        log.warning(
            "received %s: finishing the current step, saving last.pt, then stopping",
            signal.Signals(signum).name,
        )


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
