"""The input pipeline: spans -> raw samples -> shuffled -> decoded -> batches -> tensors.

Each stage is one generator; ``ShardStream.__iter__`` composes them for one
DataLoader worker. Whatever goes wrong with the data, a worker yields exactly
the number of full batches its plan says, so every replica runs the same
number of steps and no pod waits forever in an all-reduce.

With ``in_memory=True`` the split is read and decoded once into shared memory
(``load_split_memory``), and the reading and decoding stages are replaced by
lookups in it (``read_memory_samples``, ``take_memory_samples``); the other
stages are the same, so the batches are identical to the streamed ones.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tpustream import storage
from tpustream.data.augment import draw_crop_flip, random_crop_flip
from tpustream.data.decode import ImageDecoder, SampleError
from tpustream.data.manifest import ShardManifest
from tpustream.data.sharding import (
    EpochLayout,
    SampleSpan,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    worker_batches,
)
from tpustream.data.tar_stream import ShardFormatError, iter_shard_samples
from tpustream.errors import ConfigError, DataError, TpustreamError

log = logging.getLogger(__name__)

ON_ERROR_POLICIES = ("skip", "raise")
# Bad samples logged per worker and epoch; the rest are only counted.
MAX_LOGGED_ERRORS = 20


class ErrorPolicy:
    """data.on_error for one worker: log (a bounded number of) bad samples, or raise."""

    def __init__(self, mode: str):
        if mode not in ON_ERROR_POLICIES:
            raise ValueError(f"data.on_error must be one of {ON_ERROR_POLICIES}, got {mode!r}")
        self.mode = mode
        self.logged = 0

    def __call__(self, url: str, key: str | None, reason: str) -> None:
        where = f"{url} sample {key}" if key else url
        if self.mode == "raise":
            raise DataError(f"{where}: {reason}")
        if self.logged < MAX_LOGGED_ERRORS:
            log.warning("skipping bad data: %s: %s", where, reason)
        elif self.logged == MAX_LOGGED_ERRORS:
            log.warning("more bad samples in this worker; counting without logging")
        self.logged += 1


@dataclass
class DecodedSample:
    image: np.ndarray  # uint8 (C, H, W)
    label: int
    real: bool  # False for the wrap-around padding of the last global batch
    sample_id: int = -1


SHARD_ID_SHIFT = 32  # sample id = shard index in the manifest << 32 | sample index in the shard


def read_span_samples(
    spans: Iterable[SampleSpan], on_error: ErrorPolicy, shard_index: dict[str, int]
) -> Iterator[dict]:
    """Raw samples of each span, tagged with whether they are padding and with their id.

    A shard that cannot be opened is an error whatever the policy (it names
    the URL). A truncated or corrupt shard ends that span early; the batching
    stage fills the gap.
    """
    spans = list(spans)
    upcoming = storage.open_read(spans[0].url) if spans else None
    for index, span in enumerate(spans):
        stream = upcoming
        # Open the next shard now: on GCS its first bytes download (on the
        # stream's read-ahead thread) while this one is decoded, hiding the
        # per-shard request latency.
        upcoming = storage.open_read(spans[index + 1].url) if index + 1 < len(spans) else None
        try:
            with stream:
                shard_id = shard_index[span.url] << SHARD_ID_SHIFT
                for sample in iter_shard_samples(stream, span.url, span.start, span.stop):
                    sample["__padding__"] = span.padding
                    sample["__id__"] = shard_id | sample["__index__"]
                    yield sample
        except ShardFormatError as exc:
            on_error(span.url, None, str(exc).removeprefix(f"{span.url}: "))
        except BaseException:
            if upcoming is not None:
                upcoming.close()
            raise


Item = TypeVar("Item")


def shuffle_samples(samples: Iterable[Item], buffer_size: int, rng: np.random.Generator) -> Iterator[Item]:
    """Shuffle through a buffer of encoded samples (memory: buffer_size samples).

    The draws depend only on the number of items, not on what they are, so
    sample references from memory come out in the order streamed samples would.
    """
    if buffer_size <= 1:
        yield from samples
        return
    buffer: list[Item] = []
    picks: list[int] = []  # random slots drawn in blocks: one call per sample cost ~1.6 us
    for sample in samples:
        if len(buffer) < buffer_size:
            buffer.append(sample)
            continue
        if not picks:
            picks = rng.integers(buffer_size, size=1024).tolist()
        index = picks.pop()
        buffer[index], sample = sample, buffer[index]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def decode_samples(
    samples: Iterable[dict], decoder: ImageDecoder, on_error: ErrorPolicy
) -> Iterator[DecodedSample]:
    """Decoded samples; bad ones are reported to the policy and left out."""
    for sample in samples:
        try:
            image, label = decoder(sample)
        except SampleError as exc:
            on_error(sample["__url__"], sample["__key__"], str(exc))
            continue
        yield DecodedSample(image, label, not sample["__padding__"], sample.get("__id__", -1))


class SampleRef(NamedTuple):
    """One sample of a split held in memory, as it passes the shuffle and the resume skip."""

    row: int  # in SplitMemory.images; -1 for a sample that failed to decode when loaded
    real: bool  # False for the wrap-around padding of the last global batch
    sample_id: int


@dataclass
class SplitMemory:
    """A split decoded once into shared memory, addressed by (shard in the manifest, sample in the shard).

    The tensors are in shared memory, so pickling this to a DataLoader worker
    (torch's multiprocessing reductions) passes a handle, not the bytes.
    """

    images: torch.Tensor  # uint8 (N, C, H, W): the samples that decoded
    labels: torch.Tensor  # int64 (N,)
    rows: torch.Tensor  # int64 (listed samples,): sample i of shard s at shard_starts[s] + i; -1 if bad
    shard_starts: list[int]
    # Samples each shard's reader delivered before it ended: its listed count,
    # or fewer when it is truncated or corrupt.
    delivered: list[int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.images, self.labels, self.rows))


def share_tensor(tensor: torch.Tensor, split: str) -> torch.Tensor:
    """tensor moved into shared memory, or a ConfigError saying how to make room."""
    try:
        return tensor.share_memory_()
    except RuntimeError as exc:
        raise ConfigError(
            f"{split}: cannot put {tensor.numel() * tensor.element_size()} bytes of the split in shared "
            f"memory ({str(exc).splitlines()[0]}); give /dev/shm room (docker run --shm-size) "
            "or set data.in_memory=false"
        ) from None


def load_split_memory(manifest: ShardManifest, decoder: ImageDecoder, on_error: ErrorPolicy) -> SplitMemory:
    """Read and decode every sample of a split once, into shared memory.

    Each shard is read as one span of its listed samples: as far as the
    streamed span ending at its last sample reads, so a truncated shard
    delivers here the same samples it delivers there (``read_memory_samples``
    relies on it). Bad samples and shards go to on_error once, here.
    """
    started = time.perf_counter()
    listed = manifest.num_samples
    shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
    shard_starts = list(itertools.accumulate((shard.samples for shard in manifest.shards), initial=0))[:-1]
    delivered = [0] * len(manifest.shards)
    rows = np.full(listed, -1, np.int64)
    labels = np.empty(listed, np.int64)
    # Shared before it is filled: the unfilled pages of the private tensor are
    # never touched, so the split is in RAM once, not twice.
    images = share_tensor(torch.empty((listed, *decoder.shape), dtype=torch.uint8), manifest.split)
    image_rows = images.numpy()
    count = 0
    spans = [SampleSpan(shard.url, 0, shard.samples) for shard in manifest.shards]
    for sample in read_span_samples(spans, on_error, shard_index):
        shard, index = sample["__id__"] >> SHARD_ID_SHIFT, sample["__index__"]
        delivered[shard] = index + 1
        try:
            image_rows[count], labels[count] = decoder(sample)
        except SampleError as exc:
            on_error(sample["__url__"], sample["__key__"], str(exc))
            continue
        rows[shard_starts[shard] + index] = count
        count += 1
    if count < listed:
        images = share_tensor(images[:count].clone(), manifest.split)
    memory = SplitMemory(
        images,
        share_tensor(torch.from_numpy(labels[:count].copy()), manifest.split),
        share_tensor(torch.from_numpy(rows), manifest.split),
        shard_starts,
        delivered,
    )
    log.info(
        "%s split in memory: %d of %d listed samples, %.1f MB shared, loaded in %.2f s",
        manifest.split,
        count,
        listed,
        memory.nbytes / 1e6,
        time.perf_counter() - started,
    )
    return memory


def read_memory_samples(
    spans: Iterable[SampleSpan], memory: SplitMemory, shard_index: dict[str, int]
) -> Iterator[SampleRef]:
    """References to the samples of each span, as read_span_samples would yield them.

    A span stops where its shard's reader stopped when the split was loaded
    (a truncated shard ends the span early, as streaming does). Samples that
    failed to decode stay in, with row -1, because the shuffle draws and the
    resume skip count them when streaming; take_memory_samples leaves them out.
    """
    rows = memory.rows.numpy()
    for span in spans:
        shard = shard_index[span.url]
        first = memory.shard_starts[shard]
        stop = min(span.stop, memory.delivered[shard])
        shard_id = shard << SHARD_ID_SHIFT
        real = not span.padding
        for index, row in enumerate(rows[first + span.start : first + stop].tolist(), span.start):
            yield SampleRef(row, real, shard_id | index)


def take_memory_samples(refs: Iterable[SampleRef], memory: SplitMemory) -> Iterator[DecodedSample]:
    """The samples behind the references (views of shared memory), leaving out bad ones.

    Bad samples were reported to the error policy once, when the split was
    loaded; batch_samples fills their places as it does for streamed ones.
    """
    images = memory.images.numpy()
    labels = memory.labels.numpy()
    for ref in refs:
        if ref.row >= 0:
            yield DecodedSample(images[ref.row], int(labels[ref.row]), ref.real, ref.sample_id)


@dataclass
class Batch:
    images: np.ndarray  # uint8 (B, C, H, W)
    labels: np.ndarray  # int64 (B,)
    real: np.ndarray  # bool (B,): counts in loss and metrics
    filled: int  # samples the plan expected but the data did not deliver
    sample_ids: np.ndarray  # int64 (B,), -1 for places filled after bad data


def batch_samples(
    samples: Iterable[DecodedSample], batch_size: int, num_batches: int, shape: Sequence[int]
) -> Iterator[Batch]:
    """Exactly num_batches full batches, whatever the stream delivers.

    If bad data leaves the stream short, the missing places repeat images
    already seen by this worker (or zeros if there are none), marked not real,
    so shapes and step counts stay fixed. Surplus samples are never read.
    """
    images = np.empty((batch_size, *shape), np.uint8)
    labels = np.empty(batch_size, np.int64)
    real = np.empty(batch_size, bool)
    ids = np.empty(batch_size, np.int64)
    source = iter(samples)
    reserve: Batch | None = None
    for _ in range(num_batches):
        count = 0
        for sample in source:
            images[count] = sample.image
            labels[count] = sample.label
            real[count] = sample.real
            ids[count] = sample.sample_id
            count += 1
            if count == batch_size:
                break
        filled = batch_size - count
        if filled:
            if reserve is None and count == 0:
                images[:] = 0
                labels[:] = 0
            else:
                donor = (
                    reserve
                    if reserve is not None
                    else Batch(images[:count].copy(), labels[:count].copy(), real, 0, ids)
                )
                take = np.arange(filled) % len(donor.labels)
                images[count:] = donor.images[take]
                labels[count:] = donor.labels[take]
            real[count:] = False
            ids[count:] = -1
        batch = Batch(images.copy(), labels.copy(), real.copy(), filled, ids.copy())
        reserve = batch
        yield batch


def augment_batches(
    batches: Iterable[Batch], rng: np.random.Generator | None, crop_padding: int, hflip: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Augment (when rng is given, i.e. training) and wrap each batch as tensors.

    Images stay uint8: the trainer normalises them on the device.
    """
    for batch in batches:
        images = batch.images
        if rng is not None:
            images = random_crop_flip(images, crop_padding, hflip, rng)
        yield {
            "image": torch.from_numpy(images),
            "label": torch.from_numpy(batch.labels),
            "real": torch.from_numpy(batch.real.astype(np.float32)),
            "filled": torch.tensor(batch.filled, dtype=torch.int64),
            "sample_id": torch.from_numpy(batch.sample_ids),
        }


class ShardStream(IterableDataset):
    """One replica's batches of one split, for a DataLoader with batch_size=None.

    Each batch is {"image": uint8 (B, C, H, W), "label": int64 (B,), "real":
    float32 (B,) 1 for samples that count in loss and metrics, "filled": the
    number of places bad data left empty}.

    in_memory=True reads and decodes the whole split once, at construction,
    into shared memory, and serves the same batches from there.
    """

    def __init__(
        self,
        manifest: ShardManifest,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        train: bool,
        seed: int,
        shuffle_buffer: int = 0,
        last_batch: str = "pad",
        on_error: str = "skip",
        crop_padding: int = 4,
        hflip: bool = True,
        in_memory: bool = False,
    ):
        super().__init__()
        self.manifest = manifest
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.train = train
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer if train else 0
        self.on_error = on_error
        self.crop_padding = crop_padding
        self.hflip = hflip
        height, width = manifest.image_size
        self.decoder = ImageDecoder(
            manifest.image_format, manifest.channels, height, width, manifest.num_classes
        )
        # Validation always pads and masks so it covers every sample once.
        self.layout: EpochLayout = plan_layout(
            manifest.num_samples, batch_size, world_size, last_batch if train else "pad", manifest.split
        )
        self.shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
        # Loaded here, in the replica's main process, not on first iteration:
        # with DataLoader workers __iter__ only ever runs in the workers, which
        # receive this object by pickling when the loader first iterates. Loaded
        # before that, it reaches them as handles to the one shared copy rather
        # than being read by each worker. A bad split under on_error=raise then
        # also stops the run at start-up, before any step is compiled.
        self.memory: SplitMemory | None = (
            load_split_memory(manifest, self.decoder, ErrorPolicy(on_error)) if in_memory else None
        )
        # Shared with persistent DataLoader workers, which hold their own
        # copy of this object: they read the epoch when each epoch starts.
        self._epoch = multiprocessing.RawValue("q", 0)
        self._skip = multiprocessing.RawValue("q", 0)

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch's shard order and random streams (before iterating)."""
        self._epoch.value = epoch
        # Resuming mid-epoch: the first skip_batches batches of this epoch were
        # trained on before the checkpoint; yield exactly the ones after them.
        self._skip.value = skip_batches

    def worker_role(self, worker: int, workers: int) -> tuple[int, int]:
        """(the worker of the uninterrupted epoch this worker stands for, its batches to skip).

        The DataLoader takes batches from its workers round-robin, starting
        at worker 0, and the workers' counts differ by at most one (extra ones
        go to the lowest workers), so batch b of an epoch comes from worker
        b % workers. A pass resumed after `skip` batches starts at batch skip,
        so DataLoader worker i plays worker (i + skip) % workers, which skips
        the ones of its batches that came before.
        """
        skip = self._skip.value
        role = (worker + skip) % workers
        return role, max(0, -(-(skip - role) // workers))

    def __len__(self) -> int:
        """Batches of the current pass (an epoch, or what is left of it when resuming)."""
        return self.layout.steps - self._skip.value

    def worker_spans(self, worker: int, workers: int) -> list[SampleSpan]:
        shards = order_shards(self.manifest.shards, self.seed, self.epoch, shuffle=self.train)
        replica = split_by_replica(shards, self.layout, self.rank)
        return split_by_worker(replica, self.batch_size, worker, workers)

    def _rng(self, worker: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, self.rank, worker, stream])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        worker, skip = self.worker_role(worker, workers)
        on_error = ErrorPolicy(self.on_error)
        spans = self.worker_spans(worker, workers)
        samples: Iterator[dict] | Iterator[SampleRef]
        if self.memory is None:
            samples = read_span_samples(spans, on_error, self.shard_index)
        else:
            samples = read_memory_samples(spans, self.memory, self.shard_index)
        if self.train:
            samples = shuffle_samples(samples, self.shuffle_buffer, self._rng(worker, 1))
        # Skipped samples are read and shuffled (the shuffle depends on them)
        # but not decoded.
        samples = itertools.islice(samples, skip * self.batch_size, None)
        if self.memory is None:
            decoded = decode_samples(samples, self.decoder, on_error)
        else:
            decoded = take_memory_samples(samples, self.memory)
        batches = batch_samples(
            decoded,
            self.batch_size,
            worker_batches(self.layout.steps, worker, workers) - skip,
            self.decoder.shape,
        )
        rng = self._rng(worker, 2) if self.train else None
        if rng is not None:
            for _ in range(skip):
                draw_crop_flip(rng, self.batch_size, self.crop_padding, self.hflip)
        return augment_batches(batches, rng, self.crop_padding, self.hflip)


class CountingLoader:
    """Iterates a DataLoader, taking the host-only fields out of each batch.

    'filled' is summed per epoch; 'sample_id' is kept (for the real samples)
    when record_ids is set, for exactness audits. A worker's exception comes
    out as our own one-line error (DataLoader wraps it in a "Caught X in
    DataLoader worker" text with the worker traceback). The trainer calls
    ``raise_if_incomplete`` after each loop as a last line of defence: a
    replica that ran fewer steps than planned would leave the others waiting
    in an all-reduce.
    """

    def __init__(self, loader: DataLoader, record_ids: bool = False):
        self.loader = loader
        self.record_ids = record_ids
        self.filled = 0
        self.batches = 0
        self.sample_ids: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.filled = self.batches = 0
        self.sample_ids = []
        try:
            for batch in self.loader:
                self.filled += int(batch.pop("filled"))
                ids = batch.pop("sample_id")
                if self.record_ids:
                    self.sample_ids.append(ids[batch["real"] > 0].numpy())
                self.batches += 1
                yield batch
        except TpustreamError as exc:
            raise _unwrap_worker_error(exc) from exc

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
