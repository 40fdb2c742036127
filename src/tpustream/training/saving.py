"""best.pt and last.pt of a run: what the training loop waits for when it saves, and what it does not.

With checkpoint.asynchronous (the default) a save costs the loop one copy of
the state into host memory (a collective: every replica cuts its graph at the
same point; under fsdp the same gather as a synchronous save) and a barrier;
the master's background writer (checkpoint.background) serialises, hashes,
writes and verifies it while training goes on. One save is in flight at most:
the next one first waits for it. A stop (SIGTERM, exit 75) and the run's end
wait until every save is durable (wait_durable), so nothing is lost to a
stop; a kill -9 loses the steps since the last save that completed, and the
atomic writes keep the previous file whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from tpustream import checkpoint, preemption
from tpustream.checkpoint.background import BackgroundWriter
from tpustream.checkpoint.local_tier import local_checkpoint_url
from tpustream.config import TrainConfig
from tpustream.errors import StorageError
from tpustream.observe.xla_metrics import format_bytes
from tpustream.runtime import Runtime
from tpustream.runtime.device import tensor_bytes
from tpustream.runtime.staging import HostStaging

log = logging.getLogger(__name__)


def available_host_bytes() -> int | None:
    """Memory this host can still give without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class SaveSeconds(NamedTuple):
    """A writer's saving since the previous take_seconds, in the order LoopTimer.breakdown takes it.

    stall: what the training loop waited for saves; write: the serialising
    and writing, in the background or not. Of the stall, copy is taking the
    state and copying it to host memory (what every save costs the loop,
    asynchronous or not; under XLA it first waits for the device to run the
    steps queued before it), writer_wait the wait for the background writer
    to finish the previous save; the rest is synchronous writing and barriers.
    """

    stall: float
    write: float
    copy: float
    writer_wait: float


class CheckpointWriter:
    """best.pt and last.pt of a run folder; what storage refused is kept locally and named at the end.

    What the training loop waits for, and what it does not, counts in
    SaveSeconds' parts, since take_seconds.
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime):
        self.runtime = runtime
        self.output_dir = cfg.output_dir
        self.fallback_dir = cfg.checkpoint.fallback_dir or os.path.join(
            cfg.log_dir or tempfile.gettempdir(), "unsaved"
        )
        self.max_bytes = cfg.checkpoint.asynchronous_max_bytes
        local_dir = cfg.checkpoint.local_dir
        self.local_first = None if local_dir is None else local_checkpoint_url(local_dir, cfg.output_dir)
        self.unsaved: list[str] = []
        # data.synthetic trained on no data: weights nobody should take for a model, and
        # nothing to resume (its run restarts in seconds). Every replica skips alike.
        self.writes = not cfg.data.synthetic
        # Only the master writes; the other replicas take part in the collectives.
        self.background = BackgroundWriter() if cfg.checkpoint.asynchronous and runtime.is_master else None
        self.staging = HostStaging(pin_memory=getattr(runtime.device, "type", "") == "cuda")
        self.stall_seconds = 0.0
        self.write_seconds = 0.0
        self.copy_seconds = 0.0
        self.writer_wait_seconds = 0.0
        self._last_save: tuple | None = None
        self._said_synchronous = False

    def save(
        self,
        name: str,
        state: Callable[[], dict[str, Any]],
        copies: tuple[str, ...] = (),
        position: tuple[int, ...] | None = None,
        then: Callable[[], None] = lambda: None,
    ) -> None:
        """Save checkpoint `name` of state(), and copies of it (every replica calls this; the master writes).

        state is a collective, taken only when something is written. A save of
        the same name, copies and position as the previous one is skipped: it
        would write the same bytes again (a stop right after a save). then runs
        once the files are written (in the background with them), so what it
        writes (metrics.jsonl) never claims an epoch that best.pt and last.pt
        do not hold yet.
        """
        if not self.writes:
            then()
            return
        start = time.perf_counter()
        key = (name, copies, position)
        if position is not None and key == self._last_save:
            log.info("%s at this position is saved already (or being written); not saving it again", name)
            if self.background is not None:
                self._wait_for_writer()  # then follows the files, as always
            then()
        else:
            self._last_save = key
            self._save(name, state, copies, then)
        self.stall_seconds += time.perf_counter() - start

    def _save(self, name: str, state: Callable[[], dict], copies: tuple[str, ...], then: Callable) -> None:
        url = checkpoint.checkpoint_url(self.output_dir, name)
        targets = [checkpoint.checkpoint_url(self.output_dir, copy) for copy in copies]
        local = self.local_first if name == checkpoint.LAST else None
        if self.background is not None:
            # First: the previous save is written, and its host buffers free for this copy.
            self._wait_for_writer()
        started = time.perf_counter()
        whole = state()
        in_background = self._in_background(whole)
        # Asynchronous: into the staging buffers the previous save used (no fresh memory to fault in).
        host_state = self.runtime.state_to_host(whole, self.staging if in_background else None)
        del whole
        self.copy_seconds += time.perf_counter() - started
        if host_state is not None and in_background:
            holder = [host_state]
            del host_state  # the writer alone holds the copy while it is written

            def write() -> list[str]:
                kept = checkpoint.write_host_state(url, holder.pop, self.fallback_dir, targets, local)
                then()
                return kept

            self.runtime.barrier(f"checkpoint:{url}")
            # Last: from its start the writer competes for Python's lock with this thread.
            self.background.submit(name, write)
            return
        if host_state is not None:
            started = time.perf_counter()
            self.unsaved += checkpoint.write_host_state(url, host_state, self.fallback_dir, targets, local)
            self.write_seconds += time.perf_counter() - started
        then()  # after the files (a replica that is not the master has none of its own)
        self.runtime.barrier(f"checkpoint:{url}")

    def _in_background(self, state: dict[str, Any]) -> bool:
        """Whether the master writes this state in the background (asynchronous_max_bytes allowing).

        Auto (no asynchronous_max_bytes): if its host copy fits in the memory
        still available; once a save has kept host buffers, the next ones reuse
        them and need no more.
        """
        if self.background is None:
            return False
        kept = self.staging.nbytes
        if self.max_bytes is None and kept:
            return True  # into the buffers the previous save made: no new memory (a grown place: its own)
        size = tensor_bytes(state)
        limit = self.max_bytes
        if limit is None:
            available = available_host_bytes()
            limit = None if available is None else available + kept
        if limit is None or size <= limit:
            return True
        self.staging.release()  # a synchronous save's copy is freed once written
        if not self._said_synchronous:
            self._said_synchronous = True
            # In units that show the difference: a 1000-byte limit read "0.00 GB", as did the state.
            what = (
                f"the memory available ({format_bytes(limit)})"
                if self.max_bytes is None
                else f"checkpoint.asynchronous_max_bytes={self.max_bytes} ({format_bytes(limit)})"
            )
            log.warning(
                "checkpoint: the state's host copy (%s) is more than %s: saving synchronously, "
                "training waits for each write",
                format_bytes(size),
                what,
            )
        return False

    def _wait_for_writer(self) -> None:
        """Wait for the background writer's save in flight (counted apart: the writer was slower)."""
        start = time.perf_counter()
        self.background.wait_until_finished()
        self.writer_wait_seconds += time.perf_counter() - start

    def wait_durable(self) -> None:
        """Every save made so far is written (or kept locally) when this returns; a collective (a barrier)."""
        start = time.perf_counter()
        if self.background is not None:
            self.background.wait_until_finished()
        self.runtime.barrier("checkpoints-durable")
        self.stall_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def durable_at_exit(self) -> Iterator[None]:
        """Leave the training loop only once its saves are durable: at its end, and on a stop (exit 75).

        Every replica stops at the same point, so the stop's wait may be a
        collective; after any other error only the master's save in flight
        completes (finish_after_error), without one.
        """
        try:
            yield
        except preemption.Preempted:
            self.wait_durable()
            raise
        except BaseException:
            self.finish_after_error()
            raise
        self.wait_durable()

    def finish_after_error(self) -> None:
        """The run failed elsewhere: let the save in flight complete (it is progress), no collective."""
        if self.background is None or self.background.in_flight is None:
            return
        log.info("letting the save of %s in flight complete", self.background.in_flight)
        try:
            self.background.wait_until_finished()
        except Exception as exc:  # the run's own error is the one to report
            log.error("the checkpoint being written failed too: %s", exc)

    def take_seconds(self) -> SaveSeconds:
        """The saving since the previous call; write counts background saves finished since."""
        if self.background is not None:
            self.write_seconds += self.background.take_write_seconds()
        seconds = SaveSeconds(
            self.stall_seconds, self.write_seconds, self.copy_seconds, self.writer_wait_seconds
        )
        self.stall_seconds = self.write_seconds = self.copy_seconds = self.writer_wait_seconds = 0.0
        return seconds

    def raise_if_unsaved(self) -> None:
        """At the end of a run: training went on past failed writes; the run must not look successful."""
        if self.background is not None:
            self.unsaved += self.background.take_kept()
        if self.unsaved:
            raise StorageError(
                f"{len(self.unsaved)} checkpoint(s) could not be written to {self.output_dir}; "
                f"kept locally: {', '.join(self.unsaved)}"
            )
