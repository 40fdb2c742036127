"""Where a fired watchdog reports: the stacks file in the run folder, and the host's folder train.py reads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from typing import Any

from tpustream.errors import HUNG_EXIT_CODE
from tpustream.preemption import Preempted

log = logging.getLogger(__name__)

# Seconds a write of the stacks to the run folder may take (the storage may be what hangs).
REMOTE_WRITE_SECONDS = 30.0
# The run folder's subfolder for stacks files.
STACKS_FOLDER = "watchdog"


class Hung(Exception):
    """train.py's: a replica's watchdog found nothing progressing; its stacks are in the run folder."""

    exit_code = HUNG_EXIT_CODE


def write_stacks(output_dir: str, log_dir: str | None, rank: int, text: str, bound: float) -> str:
    """Write a stacks file to output_dir/watchdog/ within `bound` seconds; where it is.

    A remote run folder gets a local copy first (log_dir's, else the
    temporary folder's): the storage may be what hangs, and the write is
    abandoned after `bound` (it runs on a thread of its own).
    """
    from tpustream import storage

    name = f"replica-{rank}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.txt"
    url = storage.join(output_dir, STACKS_FOLDER, name)
    data = text.encode()
    local = None
    if "://" in url:
        folder = os.path.join(log_dir or tempfile.gettempdir(), STACKS_FOLDER)
        with contextlib.suppress(OSError):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, name), "wb") as out:
                out.write(data)
            local = os.path.join(folder, name)
    failure: list[BaseException] = []

    def write() -> None:
        try:
            storage.write_bytes(url, data)
        except BaseException as exc:  # told below, on the caller's thread
            failure.append(exc)

    writer = threading.Thread(target=write, name="watchdog-write", daemon=True)
    writer.start()
    writer.join(bound)
    if not writer.is_alive() and not failure:
        return url
    reason = f"not done in {bound:g} s" if writer.is_alive() else str(failure[0])
    kept = f"; they are at {local}" if local else ""
    log.error("could not write the stacks to %s (%s)%s", url, reason, kept)
    return local or url


class Reports:
    """A local folder train.py makes for its replicas: each fired watchdog's report, workers' dumps.

    train.py reads it when its replicas end (``raise_verdict``): a replica that
    exited 76 breaks xmp.spawn's pool, which hides every exit code. The
    replicas of a host watch it too: the first to fire makes the others fire.
    """

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def create(cls) -> Reports:
        return cls(tempfile.mkdtemp(prefix="tpustream-watchdog-"))

    def report_path(self, rank: int) -> str:
        return os.path.join(self.path, f"replica-{rank}.json")

    def backstop_path(self, rank: int) -> str:
        """Where faulthandler's timer writes if the watchdog's own thread cannot run (watchdog.Watchdog)."""
        return os.path.join(self.path, f"replica-{rank}.backstop.txt")

    def workers_folder(self, rank: int) -> str:
        folder = os.path.join(self.path, f"workers-{rank}")
        os.makedirs(folder, exist_ok=True)
        return folder

    def write(self, rank: int, report: dict[str, Any]) -> None:
        """A fired watchdog's report: exit_code, headline (why it fired), stacks (where they are)."""
        path = self.report_path(rank)
        with open(f"{path}.tmp", "w") as out:
            json.dump(report, out)
        os.replace(f"{path}.tmp", path)

    def _files(self, pattern: str) -> dict[int, str]:
        found = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.path):
                match = re.fullmatch(pattern, name)
                if match:
                    found[int(match[1])] = os.path.join(self.path, name)
        return found

    def read(self) -> dict[int, dict[str, Any]]:
        """The reports written so far, by rank."""
        reports = {}
        for rank, path in self._files(r"replica-(\d+)\.json").items():
            with contextlib.suppress(OSError, ValueError), open(path) as file:
                reports[rank] = json.load(file)
        return reports

    def backstops(self) -> dict[int, str]:
        """The dumps faulthandler's timer wrote, by rank (replicas whose watchdog thread could not run)."""
        dumps = {}
        for rank, path in self._files(r"replica-(\d+)\.backstop\.txt").items():
            with contextlib.suppress(OSError), open(path) as file:
                text = file.read()
            if text.strip():
                dumps[rank] = text
        return dumps

    def raise_verdict(self, output_dir: str, log_dir: str | None = None) -> None:
        """Raise Hung or Preempted if a replica's watchdog ended the run; nothing otherwise."""
        reports = self.read()
        for rank, dump in sorted(self.backstops().items()):
            if rank in reports:
                continue
            text = (
                f"tpustream watchdog, replica {rank}: its own thread did not run for longer than its "
                "allowance (a thread held Python's lock); faulthandler's dump of every thread, most "
                f"recent call first:\n\n{dump}"
            )
            where = write_stacks(output_dir, log_dir, rank, text, REMOTE_WRITE_SECONDS)
            reports[rank] = {
                "exit_code": HUNG_EXIT_CODE,
                "headline": "its watchdog's thread could not run (a thread held Python's lock)",
                "stacks": where,
            }
        if not reports:
            return
        lines = " | ".join(
            f"replica {rank}: {report['headline']}; stacks in {report['stacks']}"
            for rank, report in sorted(reports.items())
        )
        if any(report["exit_code"] == HUNG_EXIT_CODE for report in reports.values()):
            raise Hung(lines)
        raise Preempted(f"the step could not finish after the stop request, nothing saved since: {lines}")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
