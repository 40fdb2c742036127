"""The master's background checkpoint writer: one save in flight, on a thread of its own.

The shape of Orbax's AsyncCheckpointer and torch_xla's CheckpointManager.save_async:
the training loop hands over a host copy of the state and goes on; a thread
serialises, hashes, writes and verifies it (checkpoint.write_host_state, the
same bytes and the same atomic writes as a synchronous save). Only one save is
ever in flight, so the host holds at most one extra copy of the state: the next
save waits for the previous one (and the caller counts that wait as stall).

The thread is not a daemon: if the training thread fails, the interpreter
still lets the save in flight finish before the process exits, so a save that
began is never cut short by an error elsewhere. A kill -9 cuts it, and the
writes are atomic: the previous file stays whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs one save job at a time on a background thread; errors surface in the caller's thread.

    A job returns the paths where failed writes were kept (write_host_state's
    list); any other exception it raises is re-raised by the next submit or
    wait_until_finished, so a save that failed for an unexpected reason fails
    the run instead of vanishing with its thread.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._label: str | None = None
        self._lock = threading.Lock()
        self._kept: list[str] = []
        self._write_seconds = 0.0
        self.saves = 0  # jobs finished

    @property
    def in_flight(self) -> str | None:
        """The label of the save being written, or None."""
        thread = self._thread
        return self._label if thread is not None and thread.is_alive() else None

    def submit(self, label: str, job: Callable[[], list[str]]) -> float:
        """Start job in the background once the previous one is done; the seconds waited for that one."""
        waited = self.wait_until_finished()
        self._label = label
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint-writer {label}")
        self._thread.start()
        return waited

    def wait_until_finished(self) -> float:
        """Block until no save is in flight; the seconds that took. Raises what a job raised."""
        start = time.perf_counter()
        thread = self._thread
        if thread is not None:
            if thread.is_alive():
                log.debug("waiting for %s to be written", self._label)
            thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - start

    def take_kept(self) -> list[str]:
        """The paths where finished jobs kept checkpoints they could not write (since the last call)."""
        with self._lock:
            kept, self._kept = self._kept, []
        return kept

    def take_write_seconds(self) -> float:
        """Seconds the jobs finished since the last call ran for."""
        with self._lock:
            seconds, self._write_seconds = self._write_seconds, 0.0
        return seconds

    def _run(self, job: Callable[[], list[str]]) -> None:
        start = time.perf_counter()
        kept: list[str] = []
        try:
            kept = job()
        except BaseException as exc:  # kept for the caller's thread: a thread's exception reaches nobody
            self._error = exc
        with self._lock:
            self._kept += kept
            self._write_seconds += time.perf_counter() - start
            self.saves += 1
