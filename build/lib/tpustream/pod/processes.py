"""Running gcloud on this machine: each in a process group of its own, lines prefixed, stopped as a group."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from tpustream.errors import TpustreamError
from tpustream.pod.slice_spec import SliceSpec
from tpustream.pod.spec import LaunchSpec

STOP_TIMEOUT_SECONDS = 5


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


def require_gcloud(spec: LaunchSpec | SliceSpec) -> None:
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
