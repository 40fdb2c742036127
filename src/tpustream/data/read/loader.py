"""A replica's loader: the DataLoader over its ``ShardStream``, counting what arrived.

``CountingLoader`` keeps host-only fields off the device, sums the places
bad data left empty, checks that every planned batch arrived, and times
its consumer's waits for batches, split by whose lateness they were
(observe.timing.BatchWaits).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker

import numpy as np
import torch
from torch.utils.data import DataLoader

from tpustream import progress, watchdog
from tpustream.data.read.assemble import SlotBatches, in_background
from tpustream.data.read.stream import ShardStream
from tpustream.errors import DataError, TpustreamError
from tpustream.observe.timing import MADE, BatchWaits
from tpustream.preemption import exit_with_parent, stop_signals_blocked

# Batches the receiving thread has ready ahead of the consumer.
READY_BATCHES = 2
# Shards with bad data each replica remembers per pass, for the error that names them.
MAX_BAD_SHARDS = 3
# The replica's fork server imports this first: it makes the server ignore
# stop signals, then imports what every worker needs (fork_server.PRELOAD).
WORKER_PRELOAD = ["tpustream.data.read.fork_server"]


def worker_context() -> multiprocessing.context.BaseContext:
    """How DataLoader workers start: forked from a fork server that has the pipeline imported.

    Not fork: a replica has runtime threads (XLA, gRPC, the device loader's),
    and forking a threaded process can deadlock. Not spawn: a
    spawned worker imports torch and the pipeline itself, 2-4 s of CPU each,
    and a replica starts 2 x data.num_workers of them (training and
    validation), all at once. The fork server is a fresh process (started
    by fork + exec, with no threads) that imports the pipeline once; each
    worker is a fork of it (measured with 2 loaders x 2 workers: 2.6 s to the
    first batches instead of 8.1 s). It starts with the first worker and
    ignores stop signals like the workers (fork_server).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)
    return context


class CountingLoader:
    """Iterates a DataLoader, taking the host-only fields out of each batch.

    'filled' is summed per epoch; 'sample_id' is kept (for the real samples)
    when record_ids is set, for exactness audits, and stays in each batch, with
    the samples' 'key', with ids_in_batch (tpustream.data.ShardLoader's
    batches carry them). A worker's exception comes out as our own one-line
    error (DataLoader wraps it in a "Caught X in DataLoader worker" text with
    the worker traceback). ``raise_if_incomplete`` is called after each pass as
    a last line of defence: a replica that ran fewer steps than planned would
    leave the others waiting in an all-reduce.

    tpustream.data.ShardLoader drives it.
    """

    def __init__(
        self,
        loader: DataLoader,
        record_ids: bool = False,
        pin_device: torch.device | None = None,
        decode: Callable[[dict], dict] | None = None,
        ids_in_batch: bool = False,
    ):
        self.loader = loader
        self.record_ids = record_ids
        self.ids_in_batch = ids_in_batch
        # The GPU batches go to: their images are then put in page-locked
        # memory, by the one copy out of the workers' shared slots.
        self.pin_device = pin_device
        # data.decode=device: what makes a batch's images of its JPEGs (data.read.device_decode).
        self.decode = decode
        self._receiving: Iterator[dict] | None = None  # the current pass's receiving thread, if any
        self.filled = 0
        self.batches = 0
        self.sample_ids: list[np.ndarray] = []
        self.bad_shards: list[str] = []  # this pass's shards with bad data, first MAX_BAD_SHARDS
        self.waits = BatchWaits()  # this pass's waits for batches, and for their making
        if loader.num_workers > 0:
            watchdog.watch_workers(self.worker_pids)  # a watchdog that fires asks them for their stacks

    def __len__(self) -> int:
        """Batches of the current pass."""
        return len(self.loader) // self.loader.dataset.pieces_per_batch

    @property
    def steps(self) -> int:
        """Batches of a whole epoch (the layout's, whatever this pass skips)."""
        return self.loader.dataset.layout.steps

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch the next pass yields, from its batch skip_batches on (see ShardStream)."""
        self.loader.dataset.set_epoch(epoch, skip_batches=skip_batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.filled = self.batches = 0
        self.sample_ids = []
        self.bad_shards = []
        self.waits = waits = BatchWaits()
        try:
            asked = time.monotonic()
            for batch in self.assembled():
                progress.beat("a batch received")
                waits.add(asked, time.monotonic(), batch.pop(MADE, None))
                self.filled += int(batch.pop("filled"))
                for url in batch.pop("bad_shards", ()):
                    if len(self.bad_shards) < MAX_BAD_SHARDS and url not in self.bad_shards:
                        self.bad_shards.append(url)
                ids = batch["sample_id"] if self.ids_in_batch else batch.pop("sample_id")
                if not self.ids_in_batch:
                    batch.pop("key", None)
                if self.record_ids:
                    self.sample_ids.append(ids[batch["real"] > 0].numpy())
                self.batches += 1
                yield batch
                asked = time.monotonic()
        except TpustreamError as exc:
            raise _unwrap_worker_error(exc) from exc

    def assembled(self) -> Iterator[dict]:
        """This pass's whole batches, every field (filled and sample_id included).

        With workers, they write into the stream's shared slots
        (data.read.assemble) and a thread of this process receives their
        pieces and copies each batch out, a couple of batches ahead of the
        consumer.
        """
        dataset = self.loader.dataset
        slots = getattr(dataset, "slots", None) if self.loader.num_workers > 0 else None
        decode = self.decode
        if slots is None and (decode is None or self.loader.num_workers == 0):
            batches = self.batches_of(iter(self.loader))
            return batches if decode is None else map(decode, batches)
        # One pass at a time drives the DataLoader: an abandoned pass's thread stops first.
        self._stop_receiving()
        if slots is None:  # the workers send JPEGs: the thread receives and decodes them
            self._receiving = in_background(
                lambda: map(decode, self.batches_of(iter(self.loader))), READY_BATCHES, _nothing
            )
            return self._receiving
        slots.begin_pass()
        assemble = SlotBatches(slots, dataset.pieces_per_batch, self.pin_device, dataset.complete)
        self._receiving = in_background(lambda: assemble(iter(self.loader)), READY_BATCHES, slots.abandon)
        return self._receiving

    def _stop_receiving(self) -> None:
        if self._receiving is not None:
            with contextlib.suppress(ValueError):  # executing on another thread: it ends with the workers
                self._receiving.close()
            self._receiving = None

    def batches_of(self, items: Iterator[dict]) -> Iterator[dict]:
        """The DataLoader's items as batches: one piece per worker each under a canonical partition.

        The DataLoader takes its workers round-robin, so a batch's pieces arrive consecutively.
        """
        dataset = self.loader.dataset
        count = dataset.pieces_per_batch
        if count == 1 and dataset.pieces_draw:
            yield from items
            return
        while pieces := [piece for _, piece in zip(range(count), items, strict=False)]:
            yield dataset.join(pieces)

    def start_workers(self) -> None:
        """Start the persistent DataLoader workers now, immune to stop signals from their first moment.

        Called at set-up (not on first iteration, which happens on
        MpDeviceLoader's thread). The fork server is started with this
        thread's stop signals blocked, so it starts immune and ignores them
        itself from its first import (fork_server); the workers are its forks.
        multiprocessing's resource tracker unblocks both signals on its way
        out when it starts, so it is started first. The workers then begin
        the current pass; the first real iteration resets them to the epoch
        set by then (DataLoader's persistent-worker reset), so batches are
        the same.
        """
        if (
            self.loader.num_workers == 0
            or not self.loader.persistent_workers
            or self.loader._iterator is not None
        ):
            return
        resource_tracker.ensure_running()
        with stop_signals_blocked():
            self.loader._iterator = self.loader._get_iterator()

    def worker_pids(self) -> list[int]:
        """The pids of the DataLoader's worker processes now (none before they start)."""
        iterator = getattr(self.loader, "_iterator", None)
        workers = getattr(iterator, "_workers", None) or []
        return [worker.pid for worker in workers if worker.pid is not None and worker.is_alive()]

    def tell_workers_to_stop(self) -> None:
        """Ask the workers to leave their loop, without waiting (close waits).

        Each takes a second or so to exit (a Python process with torch
        loaded); told together, the workers of several loaders exit at once.
        """
        self._abandon_slots()
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is None or not hasattr(iterator, "_mark_worker_as_unavailable"):
            return
        iterator._workers_done_event.set()
        for worker_id in range(len(iterator._workers)):
            iterator._mark_worker_as_unavailable(worker_id, shutdown=True)

    def close(self) -> None:
        """Stop the DataLoader's persistent workers now.

        They ignore SIGTERM (a preempted replica must outlive the signal), so
        they must not be left to multiprocessing's exit handler, which
        terminates daemon children with SIGTERM and then joins them forever.
        DataLoader has no public close; its iterator's shutdown tells the
        workers to leave their loop, joins them, and kills stragglers.
        """
        self._abandon_slots()
        self._stop_receiving()
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            # A worker stuck where it cannot see the request (a user's stage blocked in a
            # read) outlives the join's timeout, and the SIGTERM torch then sends it is
            # ignored by design: it would keep this process from exiting (multiprocessing
            # joins its daemon children at exit, without a timeout).
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=5)
        self.loader._iterator = None

    def _abandon_slots(self) -> None:
        """Workers waiting for a slot go on, so that they can see they are told to stop."""
        slots = getattr(self.loader.dataset, "slots", None)
        if slots is not None:
            slots.abandon()

    def raise_if_incomplete(self, split: str) -> None:
        if self.batches != len(self):
            raise DataError(f"{split} loader yielded {self.batches} of {len(self)} planned batches")


def close_loaders(*loaders: CountingLoader) -> None:
    """Stop the workers of every loader, all of them at once."""
    for loader in loaders:
        loader.tell_workers_to_stop()
    for loader in loaders:
        loader.close()


def _unwrap_worker_error(exc: TpustreamError) -> TpustreamError:
    """Our one-line error back out of DataLoader's "Caught X in DataLoader worker" text."""
    if exc.args and "Original Traceback" in str(exc.args[0]):
        last = str(exc.args[0]).strip().splitlines()[-1]
        prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
        return type(exc)(last.removeprefix(prefix))
    return exc


def _start_worker(
    loader_pid: int, dumps_folder: str | None, init: Callable[[int], None] | None, worker_id: int
) -> None:
    """A worker's first call: it dies with the process that made its loader, dumps its stacks
    when that process's watchdog asks (watchdog.enable_worker_dumps); then the caller's init.

    The workers are forks of the fork server, so torch's worker watchdog,
    which follows a worker's parent, follows the server, and the server lives
    as long as its forks do: a loader's process that died without closing its
    loader (SIGKILL, the OOM killer) would leave its workers and the server
    behind for good, deaf to SIGTERM.
    """
    exit_with_parent(parent=loader_pid)
    watchdog.enable_worker_dumps(dumps_folder)
    if init is not None:
        init(worker_id)


def make_loader(
    stream: ShardStream,
    num_workers: int,
    prefetch_factor: int = 4,
    worker_init_fn: Callable[[int], None] | None = None,
    record_ids: bool = False,
    pin_device: torch.device | None = None,
    decode_device: torch.device | None = None,
    ids_in_batch: bool = False,
) -> CountingLoader:
    """A DataLoader over a ShardStream (its num_workers must match the stream's plan).

    pin_device: the GPU the batches go to (with workers, they are then in page-locked memory).
    decode_device: where a stream of JPEGs (data.decode=device) is decoded; default the CPU.
    ConfigError if it cannot decode there.
    """
    if num_workers != stream.num_workers:
        raise ValueError("the stream was planned for a different number of workers")
    loader = DataLoader(
        stream,
        batch_size=None,
        # The stream's items as they are: DataLoader's default would turn a
        # worker's numpy arrays into tensors, each then sent as a
        # shared-memory file of its own (data.read.assemble).
        collate_fn=_unchanged,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        # Workers start once per run, not per epoch: starting one costs a fork
        # of the fork server and its first batch's pipeline set-up.
        persistent_workers=num_workers > 0,
        worker_init_fn=(
            functools.partial(_start_worker, os.getpid(), watchdog.worker_dumps_folder(), worker_init_fn)
            if num_workers
            else None
        ),
        multiprocessing_context=worker_context() if num_workers > 0 else None,
    )
    decode = None
    if stream.encoded:
        from tpustream.data.read.device_decode import DeviceDecoder

        channels, size, _ = stream.decoder.shape
        decode = DeviceDecoder(
            decode_device or torch.device("cpu"),
            size,
            channels,
            stream.on_error,
            [shard.url for shard in stream.manifest.shards],
        )
        decode.check()
    return CountingLoader(
        loader,
        record_ids,
        pin_device=pin_device if num_workers > 0 else None,
        decode=decode,
        ids_in_batch=ids_in_batch,
    )


def _unchanged(item: dict) -> dict:
    return item


def _nothing() -> None:
    """Nothing blocks a receiving thread of JPEGs: no slots to abandon."""
