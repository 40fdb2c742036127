"""Batches assembled where they are made: DataLoader workers write images into a shared ring of batches.

Measured before this (docs/input.md): on an H100 host with 16 vCPUs the
replica's own process kept 7.7-8.7 cores busy (0.9-1.2 s of CPU a 256-image
224-px batch) receiving batches, and the workers decoded on what was left,
which is why the rate was flat in workers; on 2 cores, 27 ms a 128-image
batch. Each worker's piece of a batch travelled as 5-7 tensors, each moved
into a new shared-memory file by the worker and received through its own
authenticated socket connection (torch's file_descriptor strategy); the
pieces were then concatenated into one more new tensor and copied into
pinned memory, on torch's intra-op threads.

Now the replica allocates, once, a ring of SLOTS whole batches in shared
memory (``BatchSlots``) before its workers start; each worker writes its
samples' pixels straight into its place in slot ``n % slots`` for the pass's
batch n, and sends only small numpy arrays (labels, ids, masks, draws) that
travel inside the pickled message. The replica's process copies each whole
batch once, out of the slot into the tensor it trains on (page-locked when
the accelerator is a GPU, so that copy is the pin), then releases the slot.
A worker waits before writing into a slot the replica has not released yet.

Passes: a pass (an epoch, or what a resumed epoch has left) numbers its
batches from 0. ``begin_pass`` starts a new generation; a worker still busy
with an abandoned pass stops waiting for releases that will never come (its
writes are harmless: the replica reads a slot only after every worker's
piece of that batch has arrived, and each worker finishes its old piece
before starting the new pass).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray

import numpy as np
import torch

from tpustream.errors import ConfigError
from tpustream.observe.timing import MADE

# Whole batches in the ring beyond data.prefetch_factor: a worker runs at
# most that many pieces ahead of what the replica has received; the spares
# cover the batch being copied out and pieces already on their way.
SPARE_SLOTS = 3
# Host batches kept for reuse (HostBatches): the ready ones, the consumer's and a few it holds on to.
HOST_BATCHES = 6
# Seconds an abandoned pass waits for its receiving thread before the loader shuts its workers down.
ABANDON_WAIT_SECONDS = 10.0
# How often a worker waiting for a slot looks again.
SLOT_POLL_SECONDS = 0.0005
_PASS, _RELEASED = 0, 1


def ring_slots(prefetch_factor: int, workers: int, pieces: bool) -> int:
    """Whole batches a loader's ring holds.

    pieces (a canonical partition): every worker writes a piece of every
    batch, so prefetch_factor batches ahead, plus the spares. Otherwise each
    worker makes whole batches, every workers-th one: two of its own in the
    ring each (one written while the other waits for the replica), so no
    worker waits on batches the others are still making, and its last one
    (the fill donor for the next) is never its slot being written.
    """
    return prefetch_factor + SPARE_SLOTS if pieces else 2 * max(workers, 1) + SPARE_SLOTS


class BatchSlots:
    """A shared ring of uint8 batches (slots, B, C, H, W) and the count of batches the replica released.

    Made in the replica's process before the DataLoader's workers start;
    they receive it by pickling (the tensor as a shared-memory handle, the
    counters as shared ctypes memory).
    """

    def __init__(self, slots: int, batch_size: int, shape: tuple[int, ...]):
        images = torch.empty((slots, batch_size, *shape), dtype=torch.uint8)
        try:
            self.images = images.share_memory_()
        except RuntimeError as exc:  # /dev/shm too small (a container's default is 64 MB)
            raise ConfigError(
                f"the DataLoader workers' {slots} shared batches of {batch_size} x {list(shape)} need "
                f"{images.nbytes / 2**20:.0f} MiB of shared memory ({str(exc).splitlines()[0]}): give "
                "/dev/shm room (docker run --shm-size), or lower data.prefetch_factor, data.num_workers "
                "or batch_size"
            ) from None
        self._state = RawArray("q", 2)  # [pass generation, batches released in it]

    @property
    def slots(self) -> int:
        return self.images.shape[0]

    # ---------------------------------------------------------------- replica

    def begin_pass(self) -> int:
        """A new pass: nothing of it is released yet; writers of older passes stop waiting."""
        self._state[_RELEASED] = 0
        self._state[_PASS] += 1
        return self._state[_PASS]

    def abandon(self) -> None:
        """No pass any more (the loader stops): every waiting writer goes on, so workers can exit."""
        self._state[_PASS] += 1

    def release(self, batch: int) -> None:
        """Batch `batch` of the current pass was copied out: its slot may be written again."""
        self._state[_RELEASED] = batch + 1

    def batch(self, batch: int) -> torch.Tensor:
        return self.images[batch % self.slots]

    # ----------------------------------------------------------------- worker

    @property
    def generation(self) -> int:
        return self._state[_PASS]

    def region(self, generation: int, batch: int, start: int, count: int) -> np.ndarray:
        """Where a worker writes samples [start, start + count) of the pass's batch `batch`.

        Waits until the replica released the batch that used the slot
        before (batch - slots), unless the pass is no longer current.
        """
        needed = batch - self.slots + 1
        state = self._state
        while state[_RELEASED] < needed and state[_PASS] == generation:
            time.sleep(SLOT_POLL_SECONDS)
        return self.images[batch % self.slots, start : start + count].numpy()


@dataclass(frozen=True)
class SlotWriter:
    """One stage's place in the batches of a pass: samples [start, start + count) of every step-th batch.

    first: the pass's number of this stage's first batch; step: batches
    between its consecutive ones (1 under a canonical partition, where
    every worker gives a piece of every batch; the workers otherwise).
    """

    slots: BatchSlots
    generation: int
    first: int
    step: int
    start: int
    count: int

    def batch_number(self, index: int) -> int:
        return self.first + index * self.step

    def region(self, index: int) -> np.ndarray:
        return self.slots.region(self.generation, self.batch_number(index), self.start, self.count)


def join_batches(parts: list[dict]) -> dict:
    """Consecutive parts of one batch (canonical streams' chunks, workers' pieces) as one batch.

    Tensors, arrays and "key" lists are concatenated in order, "filled" summed,
    "made" the latest, "bad_shards" merged; parts written into a slot name the same one. One
    part is returned as it is.
    """
    if len(parts) == 1:
        return parts[0]
    joined: dict = {}
    for name, first in parts[0].items():
        if name == "filled":
            joined[name] = sum(part[name] for part in parts)
        elif name == MADE:  # the batch is made when its last part is
            joined[name] = max(part[name] for part in parts)
        elif name == "bad_shards":
            joined[name] = list(dict.fromkeys(url for part in parts for url in part[name]))
        elif name == "key":
            joined[name] = [key for part in parts for key in part[name]]
        elif name == "slot":
            assert all(part[name] == first for part in parts), "parts of different batches"
            joined[name] = first
        elif isinstance(first, np.ndarray):
            joined[name] = np.concatenate([part[name] for part in parts])
        else:
            joined[name] = torch.cat([part[name] for part in parts])
    return joined


def as_tensors(batch: dict) -> dict:
    """A batch's numpy fields (a worker's piece travels with them inline) as tensors, "filled" as one."""
    return {
        name: torch.from_numpy(value)
        if isinstance(value, np.ndarray)
        else torch.tensor(int(value), dtype=torch.int64)
        if name == "filled"
        else value
        for name, value in batch.items()
    }


def join_pieces(pieces: list[dict]) -> dict:
    """One batch's host fields from its workers' slot pieces (join_batches), as tensors.

    The image is not among them: it is in the slot the pieces name.
    """
    joined = join_batches(pieces)
    joined.pop("slot")
    return as_tensors(joined)


def portable(piece: dict, shared: tuple[str, ...] = ()) -> dict:
    """A worker's piece with its tensors as numpy arrays: pickled inline, no shared-memory file each.

    Tensors named in `shared` stay tensors: DataLoader moves each into a
    shared-memory file and sends its handle, which for megabytes costs the
    replica less than unpickling them (data.read.encoded.SHARED_FIELDS).
    """
    return {
        name: value.numpy() if isinstance(value, torch.Tensor) and name not in shared else value
        for name, value in piece.items()
    }


class HostBatches:
    """Host batches to copy slots into, reused once nothing else holds them (the CPU path's).

    A new 38 MB tensor a batch costs the replica the kernel's page faults
    and zeroing on its first writes: its CPU a 256-image 224-px batch was
    25 ms on 2 cores with new tensors, 7 ms reused (bench.pipeline.scaling,
    2 workers). A buffer
    is reused only when no tensor but ours refers to its memory (the
    trainer, a device loader's queue or a view of it would), so a consumer
    that keeps batches keeps them intact. Page-locked memory needs none of
    this: torch's caching host allocator reuses it once the copies from it
    are done.
    """

    def __init__(self, most: int):
        self.most = most
        self.buffers: list[torch.Tensor] = []

    @staticmethod
    def _users(buffer: torch.Tensor) -> int:
        """Tensors sharing the buffer's memory (views, copies of the tensor object's C++ side)."""
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)

    def _held(self, buffers: list[torch.Tensor], index: int) -> tuple[int, int]:
        """(Python references to buffers[index], tensors on its memory), counted the same way for a probe."""
        return sys.getrefcount(buffers[index]), self._users(buffers[index])

    @functools.cached_property
    def _alone(self) -> tuple[int, int]:
        """What _held gives for a tensor only a list holds."""
        return self._held([torch.empty(1, dtype=torch.uint8)], 0)

    def take(self, shape: torch.Size) -> torch.Tensor:
        """A host batch of `shape`: a kept one nothing else refers to any more, else a new one."""
        refs, users = self._alone
        # By index: a loop variable (or enumerate's tuple) would count as a holder.
        for index in range(len(self.buffers)):
            if self.buffers[index].shape != shape:
                continue
            held_refs, held_users = self._held(self.buffers, index)
            if held_refs <= refs and held_users <= users:
                return self.buffers[index]
        buffer = torch.empty(shape, dtype=torch.uint8)
        if len(self.buffers) < self.most:
            self.buffers.append(buffer)
        return buffer


def _can_count_users() -> bool:
    try:
        HostBatches._users(torch.empty(1))
    except (AttributeError, RuntimeError):  # a private API: without it, a new tensor a batch
        return False
    return True


class SlotBatches:
    """The replica's side: the DataLoader's pieces as whole batches, each copied once out of its slot."""

    def __init__(
        self,
        slots: BatchSlots,
        pieces_per_batch: int,
        pin_device: torch.device | None = None,
        complete: Callable[[dict], dict] | None = None,
    ):
        """pin_device: the GPU the batches go to; they are then copied into page-locked memory.

        complete: what the joined batch still needs (the device's draws, when
        workers' pieces split an augmentation group: ShardStream.complete).
        """
        self.slots = slots
        self.pieces_per_batch = pieces_per_batch
        self.complete = complete
        self.pin_device = pin_device
        self.host = HostBatches(HOST_BATCHES) if pin_device is None and _can_count_users() else None

    def __call__(self, items: Iterator[dict]) -> Iterator[dict]:
        count = self.pieces_per_batch
        pin = self.pin_device is not None
        if pin:
            # Page-locked memory is allocated in the current device's context:
            # on this thread it would be GPU 0's, which another replica's GPU
            # would then hold a context on (DataLoader's pin thread does the same).
            torch.cuda.set_device(self.pin_device.index if self.pin_device.index is not None else 0)
        batch = 0
        while pieces := [piece for _, piece in zip(range(count), items, strict=False)]:
            if len(pieces) != count or any(piece["slot"] != batch for piece in pieces):
                got = [piece["slot"] for piece in pieces]
                raise RuntimeError(f"batch {batch}: expected {count} pieces of it, got pieces of {got}")
            joined = join_pieces(pieces)
            if self.complete is not None:
                joined = self.complete(joined)
            source = self.slots.batch(batch)
            if self.host is not None:
                image = self.host.take(source.shape)
            else:
                image = torch.empty(source.shape, dtype=torch.uint8, pin_memory=pin)
            # numpy's copy: one thread, without the GIL. torch's copy_ splits a
            # batch this size over every intra-op thread, which then spin,
            # waiting for more work, on the cores the workers decode on
            # (measured on 16 vCPUs: 35 ms of CPU a 256-image batch).
            np.copyto(image.numpy(), source.numpy())
            self.slots.release(batch)
            joined["image"] = image
            yield joined
            batch += 1


class _Stop:
    """The queue's end marker, carrying the exception that ended the producer, if any."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def in_background(make: Callable[[], Iterator], depth: int, on_stop: Callable[[], None]) -> Iterator:
    """make()'s items, produced on a thread up to `depth` ahead of the consumer.

    The replica's receiving and copying then overlaps the training step
    instead of running between steps (torch's copies release the GIL). An
    exception in the producer is raised here. Closing this generator early
    calls on_stop (which must unblock the producer: BatchSlots.abandon
    lets waiting workers finish their pieces) and waits for the thread.
    """
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in make():
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(_Stop())
        except BaseException as exc:  # handed to the consumer, raised there
            ready.put(_Stop(exc))

    thread = threading.Thread(target=produce, name="tpustream-batches", daemon=True)
    thread.start()
    try:
        while not isinstance(item := ready.get(), _Stop):
            yield item
        if item.error is not None:
            raise item.error
    finally:
        if thread.is_alive():
            stop.set()
            on_stop()
            # Bounded: a producer blocked inside the DataLoader, waiting for workers that only
            # the loader's shutdown (which follows a close) stops, would never end here; it
            # is a daemon and ends with them (seen once: a native run hung in close_loaders).
            give_up = time.monotonic() + ABANDON_WAIT_SECONDS
            while thread.is_alive() and time.monotonic() < give_up:
                with contextlib.suppress(queue.Empty):  # a producer blocked on a full queue
                    ready.get(timeout=0.1)
