"""TensorBoard scalars of a run, written by the master replica, uploaded to gs:// when the run is there.

Nothing here may stop a run: TensorBoard uploads that fail are logged and
retried at the next sync.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping

from tpustream import storage

log = logging.getLogger(__name__)

TENSORBOARD = "tensorboard"
# How often SummaryWriter flushes on its own, so a local run shows up in a
# TensorBoard that is already open; sync() flushes explicitly before uploads.
FLUSH_SECONDS = 10
EVENT_FILE_MARK = ".tfevents."


class TensorBoardLog:
    """Scalars for TensorBoard under ``<output_dir>/tensorboard/``, written by the master replica only.

    A local ``output_dir`` is written directly. For ``gs://`` the events go to
    ``local_dir`` (a temporary folder when None) and ``sync()`` uploads every
    event file that grew since the last sync to the same relative name under
    ``<output_dir>/tensorboard/``. Event files only grow, and GCS objects cannot
    be appended to, so a sync rewrites each grown file whole: scalar event files
    stay small (measured: 47 bytes per scalar per step).

    On a resumed run pass ``purge_step`` (the global step it resumes at):
    TensorBoard then hides the events the interrupted run wrote from that step on,
    which this run writes again.
    """

    def __init__(
        self,
        output_dir: str,
        local_dir: str | None = None,
        *,
        purge_step: int | None = None,
        flush_seconds: int = FLUSH_SECONDS,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.url = storage.join(storage.absolute(output_dir), TENSORBOARD)
        if storage.is_gcs(self.url):
            self.local_dir = os.path.abspath(local_dir or tempfile.mkdtemp(prefix="tpustream-tensorboard-"))
            self._remote: str | None = self.url
        else:
            self.local_dir = self.url
            self._remote = None
        os.makedirs(self.local_dir, exist_ok=True)
        # Files already in local_dir belong to another writer (an earlier run,
        # maybe of another output_dir): counting them as synced leaves them alone.
        self._synced_sizes: dict[str, int] = dict(self._event_files())
        self._writer = SummaryWriter(self.local_dir, purge_step=purge_step, flush_secs=flush_seconds)
        self.sync_failures = 0

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Record values (names such as "train/loss", "rate/replica_003") at a global step."""
        if self._writer is None:
            raise RuntimeError(f"TensorBoardLog for {self.url} is closed")
        for name, value in values.items():
            self._writer.add_scalar(name, float(value), global_step=step)

    def _event_files(self) -> list[tuple[str, int]]:
        """(name relative to local_dir with '/' separators, size) of every event file."""
        found = []
        for folder, _, names in os.walk(self.local_dir):
            for name in names:
                if EVENT_FILE_MARK in name:
                    path = os.path.join(folder, name)
                    relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
                    found.append((relative, os.path.getsize(path)))
        return sorted(found)

    def sync(self) -> bool:
        """Flush, and upload grown event files for gs://. False if an upload failed (logged, not raised).

        Blocks for the GCS retries (TPUSTREAM_GCS_RETRY_SECONDS) when the bucket
        is unreachable, like every other write to the run folder: call it at
        epoch boundaries, not every step.
        """
        if self._writer is not None:
            self._writer.flush()
        if self._remote is None:
            return True
        try:
            for relative, size in self._event_files():
                if self._synced_sizes.get(relative) == size:
                    continue
                with open(os.path.join(self.local_dir, relative), "rb") as f:
                    data = f.read()
                storage.write_bytes(storage.join(self._remote, relative), data)
                # What was read, not what was listed: the writer's thread may
                # have appended in between, and that part is not uploaded yet.
                self._synced_sizes[relative] = len(data)
        except Exception as exc:
            # TensorBoard data is never worth stopping a run: whatever went wrong
            # (GCS unreachable after its retries, expired credentials, a local
            # read), count it, say so, and upload the same files at the next sync.
            # Stopping at the first failure avoids waiting out the retries per file.
            self.sync_failures += 1
            log.warning(
                "could not upload TensorBoard events to %s (%s: %s); they stay in %s and the next "
                "sync tries again",
                self._remote,
                exc.__class__.__name__,
                exc,
                self.local_dir,
            )
            return False
        return True

    def close(self) -> bool:
        """Flush, close the event file and sync a last time; returns what that sync returned."""
        if self._writer is None:
            return True
        self._writer.close()
        self._writer = None
        return self.sync()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NullTensorBoardLog:
    """What replicas other than the master hold: the same methods, doing nothing."""

    url = None
    sync_failures = 0

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def sync(self) -> bool:
        return True

    def close(self) -> bool:
        return True

    def __enter__(self) -> NullTensorBoardLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass
