"""A replica's loader: the DataLoader over its ``ShardStream``, counting what arrived.

``CountingLoader`` keeps host-only fields off the device, sums the places
bad data left empty, and checks that every planned batch arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from tpustream.data.read.stream import ShardStream
from tpustream.errors import DataError, TpustreamError
from tpustream.preemption import stop_signals_ignored

# Shards with bad data each replica remembers per pass, for the error that names them.
MAX_BAD_SHARDS = 3


class CountingLoader:
    """Iterates a DataLoader, taking the host-only fields out of each batch.

    'filled' is summed per epoch; 'sample_id' is kept (for the real samples)
    when record_ids is set, for exactness audits. A worker's exception comes
    out as our own one-line error (DataLoader wraps it in a "Caught X in
    DataLoader worker" text with the worker traceback). The trainer calls
    ``raise_if_incomplete`` after each loop as a last line of defence: a
    replica that ran fewer steps than planned would leave the others waiting
    in an all-reduce.

    It is the trainer's ``training.source.EpochSource``.
    """

    def __init__(self, loader: DataLoader, record_ids: bool = False):
        self.loader = loader
        self.record_ids = record_ids
        self.filled = 0
        self.batches = 0
        self.sample_ids: list[np.ndarray] = []
        self.bad_shards: list[str] = []  # this pass's shards with bad data, first MAX_BAD_SHARDS

    def __len__(self) -> int:
        return len(self.loader)

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
        try:
            for batch in self.loader:
                self.filled += int(batch.pop("filled"))
                for url in batch.pop("bad_shards", ()):
                    if len(self.bad_shards) < MAX_BAD_SHARDS and url not in self.bad_shards:
                        self.bad_shards.append(url)
                ids = batch.pop("sample_id")
                if self.record_ids:
                    self.sample_ids.append(ids[batch["real"] > 0].numpy())
                self.batches += 1
                yield batch
        except TpustreamError as exc:
            raise _unwrap_worker_error(exc) from exc

    def start_workers(self) -> None:
        """Start the persistent DataLoader workers now, immune to stop signals from their first moment.

        Called on the replica's main thread at set-up (not on first iteration,
        which happens on MpDeviceLoader's thread, where signal dispositions
        cannot be changed). The workers then begin the current pass; the first
        real iteration resets them to the epoch set by then (DataLoader's
        persistent-worker reset), so batches are the same.
        """
        if (
            self.loader.num_workers == 0
            or not self.loader.persistent_workers
            or self.loader._iterator is not None
        ):
            return
        with stop_signals_ignored():
            self.loader._iterator = self.loader._get_iterator()

    def close(self) -> None:
        """Stop the DataLoader's persistent workers now.

        They ignore SIGTERM (a preempted replica must outlive the signal), so
        they must not be left to multiprocessing's exit handler, which
        terminates daemon children with SIGTERM and then joins them forever.
        DataLoader has no public close; its iterator's shutdown tells the
        workers to leave their loop, joins them, and kills stragglers.
        """
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None

    def raise_if_incomplete(self, split: str) -> None:
        if self.batches != len(self):
            raise DataError(f"{split} loader yielded {self.batches} of {len(self)} planned batches")


def _unwrap_worker_error(exc: TpustreamError) -> TpustreamError:
    """Our one-line error back out of DataLoader's "Caught X in DataLoader worker" text."""
    if exc.args and "Original Traceback" in str(exc.args[0]):
        last = str(exc.args[0]).strip().splitlines()[-1]
        prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
        return type(exc)(last.removeprefix(prefix))
    return exc


def make_loader(
    stream: ShardStream,
    num_workers: int,
    prefetch_factor: int = 4,
    worker_init_fn: Callable[[int], None] | None = None,
    record_ids: bool = False,
) -> CountingLoader:
    """A DataLoader over a ShardStream (its num_workers must match the stream's plan)."""
    if num_workers != stream.num_workers:
        raise ValueError("the stream was planned for a different number of workers")
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        # Workers start once per run, not per epoch: in an xmp.spawn replica
        # the start method is "spawn", and each new worker imports torch (~3 s).
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init_fn,
    )
    return CountingLoader(loader, record_ids)
