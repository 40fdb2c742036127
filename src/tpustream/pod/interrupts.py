"""Ctrl-C in the launcher: recorded by its SIGINT handler before anything else, then raised.

A Ctrl-C at any moment of a launch must end it with 130. A launcher that
inherits SIGINT blocked (the mask survives fork and exec, and Python never
unblocks it) or ignored (Python then installs no KeyboardInterrupt handler)
never hears of one: its workers run to their end and it reports success. And
Python raises its KeyboardInterrupt wherever the main thread is, even inside
a ``__del__``, which swallows it.

So main() runs the launch under ``handling()``: SIGINT unblocked, and a
handler that counts the Ctrl-C first and only then raises KeyboardInterrupt;
main() reads ``received()`` before it declares how the launch ended.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_received = 0  # Ctrl-Cs since handling() began


def _on_sigint(signum: int, frame: object) -> None:
    global _received
    _received += 1  # first: the launch knows of it whatever happens to the exception below
    raise KeyboardInterrupt


def received() -> bool:
    """Whether a Ctrl-C came since handling() began (in this process, if it handles SIGINT)."""
    return _received > 0


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Around a launch: SIGINT unblocked and handled by this module, as before afterwards.

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
