"""Ctrl-C in the launcher: recorded by its SIGINT handler before anything else, then acted on.

A Ctrl-C at any moment of a launch must end it with 130, the workers stopped.
Python's own handling cannot promise that. Its KeyboardInterrupt lands
wherever the main thread is: between starting a worker's gcloud and
recording it for stopping (that gcloud and its training then outlive the
launcher), inside the stopping of the others, or inside a ``__del__``, which
swallows it. And a launcher that inherits SIGINT blocked (the mask survives
fork and exec, and Python never unblocks it) or ignored (Python then installs
no handler) never hears of a Ctrl-C at all: its workers run to their end and
it reports success.

So main() runs the launch under ``handling()``: SIGINT unblocked, and a
handler that counts the Ctrl-C first and only then raises KeyboardInterrupt,
unless the main thread is in a ``deferred()`` section (starting and stopping
workers, cleaning up after them), which polls ``received()`` instead. The
code that declares how a launch ended reads ``received()`` too.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator

_received = 0  # Ctrl-Cs since handling() began
_deferred_up_to = 0.0  # a Ctrl-C beyond this many so far raises KeyboardInterrupt


def _on_sigint(signum: int, frame: object) -> None:
    global _received
    _received += 1  # first: the launch knows of it whatever happens to the exception below
    if _received > _deferred_up_to:
        raise KeyboardInterrupt


def received() -> bool:
    """Whether a Ctrl-C came since handling() began (in this process, if it handles SIGINT)."""
    return _received > 0


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Around a launch: SIGINT unblocked and handled by this module; handler and mask put back after.

    Only on the main thread (the only one Python runs handlers on), and not
    where SIGINT is ignored: a launcher started under ``trap '' INT``, or as a
    background job of a script, keeps ignoring Ctrl-C as any program does.
    """
    global _received
    _received = 0
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        yield
        return
    # The handler before the unblocking: a SIGINT pending since start is delivered on unblocking.
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    finally:
        # None: a handler not installed from Python, which cannot be put back; the default then.
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def deferred(up_to: float = math.inf) -> Iterator[None]:
    """Within: the first ``up_to`` Ctrl-Cs of the launch are only counted, for the code inside to poll.

    For what must not be cut in the middle: a started gcloud not yet recorded
    for stopping, the stopping of the others, the cleanup a Ctrl-C asks for
    (``up_to=1``: a second Ctrl-C abandons it). Main thread only; elsewhere a
    no-op, as the handler runs on the main thread whatever this thread does.
    """
    global _deferred_up_to
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _deferred_up_to
    _deferred_up_to = max(outer, up_to)
    try:
        yield
    finally:
        _deferred_up_to = outer
