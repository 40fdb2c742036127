"""Where every thread of a replica is: its own threads' stacks, its DataLoader workers' by faulthandler."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# The signal a DataLoader worker dumps its stacks on.
DUMP_SIGNAL = signal.SIGUSR1
# Seconds the workers get to write their stacks after the signal.
WORKER_DUMP_SECONDS = 1.0

_STANDARD_LIBRARY = os.path.normcase(sysconfig.get_paths()["stdlib"])


def _in_standard_library(filename: str) -> bool:
    path = os.path.normcase(os.path.abspath(filename))
    return path.startswith(_STANDARD_LIBRARY) and "site-packages" not in path


def _frame_text(filename: str, line: int | str, function: str) -> str:
    return f"{os.path.basename(filename)}:{line} {function}"


def where_stuck(frames: list[tuple[str, int | str, str]]) -> str:
    """A thread's innermost frame, and the innermost outside the standard library when it is in there.

    frames: (file, line, function), innermost first. A thread stuck in a
    collective or a read is most often in threading.py's wait or socket's
    recv; the caller that waits is what says which.
    """
    if not frames:
        return "no Python frame"
    innermost = _frame_text(*frames[0])
    if not _in_standard_library(frames[0][0]):
        return innermost
    caller = next((frame for frame in frames[1:] if not _in_standard_library(frame[0])), None)
    return innermost if caller is None else f"{innermost} <- {_frame_text(*caller)}"


@dataclass(frozen=True)
class ThreadStack:
    ident: int
    name: str
    where: str  # where_stuck's
    text: str  # the stack, most recent call last
    outside_standard_library: bool  # some frame of it is


def thread_stacks(first: int | None = None, skip: int | None = None) -> list[ThreadStack]:
    """Every Python thread of this process but `skip` (idents): `first`, the main thread, the rest."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    order = {first: 0, threading.main_thread().ident: 1}
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        summary = traceback.extract_stack(frame)
        innermost_first = [(entry.filename, entry.lineno or 0, entry.name) for entry in reversed(summary)]
        name = names.get(ident, f"thread {ident:#x}")
        ours = any(not _in_standard_library(frame[0]) for frame in innermost_first)
        stack = ThreadStack(ident, name, where_stuck(innermost_first), "".join(summary.format()), ours)
        stacks.append((order.get(ident, 2), stack))
    return [stack for _, stack in sorted(stacks, key=lambda pair: pair[0])]


# faulthandler's frame lines: '  File "path", line N in function'
_FAULTHANDLER_FRAME = re.compile(
    r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+|\?\?\?) in (?P<function>\S+)'
)


def faulthandler_threads(text: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """A faulthandler dump as (thread header, frames innermost first) per thread."""
    threads: list[tuple[str, list[tuple[str, str, str]]]] = []
    for line in text.splitlines():
        match = _FAULTHANDLER_FRAME.match(line)
        if match and threads:
            threads[-1][1].append((match["file"], match["line"], match["function"]))
        elif line.strip().startswith(("Thread 0x", "Current thread 0x")):
            threads.append((line.strip().rstrip(":"), []))
    return threads


def worker_where(dump: str) -> str:
    """Where a DataLoader worker's dump has its loop (the thread running _worker_loop, else the first)."""
    threads = faulthandler_threads(dump)
    loop = [frames for _, frames in threads if any(frame[2] == "_worker_loop" for frame in frames)]
    frames = loop[0] if loop else threads[0][1] if threads else []
    return where_stuck(frames) if frames else "no stack"


# -- DataLoader workers ---------------------------------------------------------

_worker_dump_file = None  # kept open: faulthandler writes to its descriptor


def enable_worker_dumps(folder: str | None) -> None:
    """In a DataLoader worker: DUMP_SIGNAL writes every thread's stack to folder/worker-PID.txt.

    faulthandler writes from the signal handler, in C, so a worker stuck in a
    system call or in C code answers too. The file gets its name once the
    handler is in place, so its name says the worker can take the signal
    (before, the signal's default action kills it).
    folder None: no watchdog asks, nothing is set up.
    """
    global _worker_dump_file
    if folder is None:
        return
    path = os.path.join(folder, f"worker-{os.getpid()}.txt")
    _worker_dump_file = open(f"{path}.starting", "w")  # noqa: SIM115
    faulthandler.register(DUMP_SIGNAL, file=_worker_dump_file, all_threads=True, chain=False)
    os.replace(f"{path}.starting", path)


# Functions that name this process's loaders' live worker pids (loaders' bound methods, held weakly).
_worker_sources: list[Callable[[], Callable[[], Iterable[int]] | None]] = []


def watch_workers(pids: Callable[[], Iterable[int]]) -> None:
    """Register a loader's bound method that names its live DataLoader worker pids (held weakly)."""
    _worker_sources[:] = [source for source in _worker_sources if source() is not None]
    _worker_sources.append(weakref.WeakMethod(pids) if hasattr(pids, "__self__") else (lambda: pids))


def worker_pids() -> list[int]:
    pids: list[int] = []
    for source in list(_worker_sources):
        function = source()
        if function is None:  # its loader is gone
            _worker_sources.remove(source)
            continue
        with contextlib.suppress(Exception):  # a loader closing meanwhile
            pids.extend(function())
    return pids


def dump_workers(folder: str) -> list[tuple[int, str]]:
    """Ask this process's DataLoader workers for their stacks: (pid, faulthandler's dump) each."""
    signalled = []
    for pid in worker_pids():
        path = os.path.join(folder, f"worker-{pid}.txt")
        if not os.path.exists(path):
            continue  # still starting: the signal would kill it, not dump it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, DUMP_SIGNAL)
            signalled.append((pid, path))
    if signalled:
        time.sleep(WORKER_DUMP_SECONDS)
    dumps = []
    for pid, path in signalled:
        with contextlib.suppress(OSError), open(path) as dump:
            dumps.append((pid, dump.read().strip() or "(no answer)"))
    return dumps
