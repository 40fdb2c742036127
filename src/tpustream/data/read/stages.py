"""The pipeline's stages: spans -> raw samples -> shuffled -> decoded -> batches -> tensors.

Each stage is one generator over the previous stage's output, so the loader
(``stream.ShardStream``) composes them as a ``webdataset.DataPipeline``.
Whatever goes wrong with the data, the batching stage yields exactly the
number of full batches the plan says, so every replica runs the same number
of steps and no pod waits forever in an all-reduce.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from tpustream import storage
from tpustream.config import OnError
from tpustream.data.format.decode import ImageDecoder, SampleError
from tpustream.data.format.tar import ShardFormatError, iter_shard_samples, open_tar_stream
from tpustream.data.read.assemble import SlotWriter
from tpustream.data.read.crop_flip import random_crop_flip
from tpustream.data.read.encoded import EncodedImage, pack_encoded
from tpustream.data.read.layout import SampleSpan
from tpustream.errors import DataError

log = logging.getLogger(__name__)

# Bad samples logged per worker and epoch; the rest are only counted.
MAX_LOGGED_ERRORS = 20
SHARD_ID_SHIFT = 32  # sample id = shard index in the split << 32 | sample index in the shard


class ErrorPolicy:
    """data.on_error for one worker: log (a bounded number of) bad samples, or raise."""

    def __init__(self, mode: OnError | str):
        try:
            self.mode = OnError(mode)
        except ValueError:
            choices = ", ".join(m.value for m in OnError)
            raise ValueError(f"data.on_error must be one of {choices}, got {mode!r}") from None
        self.logged = 0
        # data.stages entries warned of for yielding surplus samples (once per worker's stream).
        self._surplus_warned: set[str] = set()
        self._surplus_reported: set[str] = set()
        self._bad_shards: dict[str, None] = {}  # in order of first fault
        self._bad_shards_taken = 0
        self._lost = 0  # real samples bad data took out of the pass since the last take_lost

    def __call__(self, url: str, key: str | None, reason: str) -> None:
        where = f"{url} sample {key}" if key else url
        if self.mode == OnError["raise"]:
            raise DataError(f"{where}: {reason}")
        self._bad_shards.setdefault(url)
        if self.logged < MAX_LOGGED_ERRORS:
            log.warning("skipping bad data: %s: %s", where, reason)
        elif self.logged == MAX_LOGGED_ERRORS:
            log.warning("more bad samples in this worker; counting without logging")
        self.logged += 1

    def count_lost(self, samples: int = 1) -> None:
        """Count real samples that bad data took out of the pass (padding never counts)."""
        self._lost += samples

    def take_lost(self) -> int:
        """The real samples lost since the last call (a batch's "filled")."""
        lost, self._lost = self._lost, 0
        return lost

    def stage_surplus(self, path: str) -> None:
        """A data.stages entry yielded more samples than it was given (warned once per entry)."""
        message = (
            f"data.stages entry {path!r} yielded more samples than it was given; the extra ones are "
            "dropped and counted as bad data (a stage may change or drop samples, not add them: "
            "every replica must run the same steps)"
        )
        if self.mode == OnError["raise"]:
            raise DataError(message)
        if path not in self._surplus_warned:
            self._surplus_warned.add(path)
            log.warning("%s", message)

    def take_bad_shards(self) -> list[str]:
        """The shards with bad data first seen since the last call (for the error that names them)."""
        shards = list(self._bad_shards)[self._bad_shards_taken :]
        self._bad_shards_taken += len(shards)
        return shards

    def surplus(self, url: str, listed: int) -> None:
        """A shard holds more samples than its count: the extra ones are never used (warned once)."""
        if url in self._surplus_reported:
            return
        self._surplus_reported.add(url)
        message = (
            f"{url}: holds more samples than its recorded count ({listed}); only the first {listed} "
            "are used (recount with `tpustream-index --force`)"
        )
        if self.mode == OnError["raise"]:
            raise DataError(message)
        log.warning("%s", message)


@dataclass
class DecodedSample:
    image: np.ndarray | EncodedImage  # uint8 (C, H, W), or what the device decodes (data.decode=device)
    label: int
    real: bool  # False for the wrap-around padding of the last global batch
    sample_id: int = -1
    key: str = ""  # its __key__ in the shard


def read_span_samples(
    spans: Iterable[SampleSpan],
    on_error: ErrorPolicy,
    shard_index: dict[str, int],
    shard_counts: Sequence[int],
) -> Iterator[dict]:
    """Raw samples of each span, tagged with whether they are padding and with their id.

    A shard that cannot be opened is an error whatever the policy (it names
    the URL). A truncated or corrupt shard, or one holding fewer samples than
    its count, ends that span early (reported to the policy, and its missing
    samples counted); the batching stage fills the gap. A padding span's
    fault is neither reported nor counted: the same samples are read as real
    ones in the same epoch, where they are. A span reaching the end of its
    shard reads one sample further, to notice a shard holding more than its
    count.
    """
    spans = list(spans)
    upcoming = storage.open_read(spans[0].url) if spans else None
    for index, span in enumerate(spans):
        stream = upcoming
        # Open the next shard now: on GCS its first bytes download (on the
        # stream's read-ahead thread) while this one is decoded, hiding the
        # per-shard request latency.
        upcoming = storage.open_read(spans[index + 1].url) if index + 1 < len(spans) else None
        shard = shard_index[span.url]
        listed = shard_counts[shard]
        stop = span.stop + 1 if span.stop == listed else span.stop
        delivered = span.start
        # One sample of look-ahead: the last counted sample is held back until
        # the reader has looked past it, because the batching stage stops
        # pulling after its last planned sample and a surplus found only
        # then would never be reported.
        pending: dict | None = None
        try:
            try:
                with open_tar_stream(stream, span.url) as tar:
                    shard_id = shard << SHARD_ID_SHIFT
                    for sample in iter_shard_samples(tar, span.url, span.start, stop):
                        if sample["__index__"] >= listed:
                            on_error.surplus(span.url, listed)
                            break
                        delivered = sample["__index__"] + 1
                        sample["__padding__"] = span.padding
                        sample["__id__"] = shard_id | sample["__index__"]
                        if pending is not None:
                            yield pending
                        pending = sample
                fault = None
            except ShardFormatError as exc:
                fault = exc
            if pending is not None:
                yield pending
            if span.padding:
                continue
            if fault is not None:
                on_error(span.url, None, str(fault).removeprefix(f"{span.url}: "))
            elif delivered < span.stop:
                held = f"{delivered}" if delivered > span.start else f"at most {span.start}"
                on_error(span.url, None, f"holds {held} samples, but its recorded count is {listed}")
            on_error.count_lost(span.stop - delivered)
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


def skip_samples(samples: Iterable[Item], count: int, on_error: ErrorPolicy) -> Iterator[Item]:
    """All but the first `count` items: a resumed epoch's batches already trained on.

    They were read and shuffled (the shuffle depends on them) but are not
    decoded. The samples missing from shards read up to here were counted
    before the checkpoint, in those batches, so on_error forgets them.
    """
    iterator = iter(samples)
    for _ in range(count):
        if next(iterator, None) is None:
            break
    on_error.take_lost()
    yield from iterator


def decode_samples(
    samples: Iterable[dict], decoder: ImageDecoder, on_error: ErrorPolicy
) -> Iterator[DecodedSample]:
    """Decoded samples; bad ones are left out, and reported to the policy and counted unless padding.

    Padding repeats samples that are read as real ones in the same epoch, where
    a bad one is reported and counted once.
    """
    for sample in samples:
        try:
            image, label = decoder(sample)
        except SampleError as exc:
            if not sample["__padding__"]:
                on_error(sample["__url__"], sample["__key__"], str(exc))
                on_error.count_lost()
            continue
        real, sample_id = not sample["__padding__"], sample.get("__id__", -1)
        yield DecodedSample(image, label, real, sample_id, sample["__key__"])


@dataclass
class Batch:
    images: np.ndarray  # uint8 (B, C, H, W), or EncodedImage objects (B,)
    labels: np.ndarray  # int64 (B,)
    real: np.ndarray  # bool (B,): counts in loss and metrics
    # Real samples bad data took out of the plan, counted as they were met
    # (padding never counts); with the real ones, they add up to the real
    # samples of the split read in the pass.
    filled: int
    sample_ids: np.ndarray  # int64 (B,), -1 for places filled after bad data
    keys: list[str]  # the samples' __key__, "" for places filled after bad data


def batch_samples(
    samples: Iterable[DecodedSample],
    batch_size: int,
    num_batches: int,
    shape: Sequence[int],
    on_error: ErrorPolicy,
    writer: SlotWriter | None = None,
    blank: EncodedImage | None = None,
) -> Iterator[Batch]:
    """Exactly num_batches full batches, whatever the stream delivers.

    If bad data leaves the stream short, the missing places repeat images
    already seen by this worker (or zeros if there are none), marked not real,
    so shapes and step counts stay fixed. Surplus samples are never read.
    Each batch's "filled" is the real samples on_error counted lost while it
    was assembled. Images are written where the batch goes: the worker's
    place in a shared slot (writer), else a new array per batch. With
    blank (data.decode=device), samples are EncodedImages, kept in an
    object array, and a batch with no sample at all holds blanks.
    """
    labels = np.empty(batch_size, np.int64)
    real = np.empty(batch_size, bool)
    ids = np.empty(batch_size, np.int64)
    keys = [""] * batch_size
    source = iter(samples)
    reserve: Batch | None = None
    for index in range(num_batches):
        # Each batch its own array: the previous one may still be in use
        # (the reserve below, or the pickled piece on its way to the replica).
        if blank is not None:
            images = np.empty(batch_size, object)
        elif writer is not None:
            images = writer.region(index)
        else:
            images = np.empty((batch_size, *shape), np.uint8)
        count = 0
        for sample in source:
            images[count] = sample.image
            labels[count] = sample.label
            real[count] = sample.real
            ids[count] = sample.sample_id
            keys[count] = sample.key
            count += 1
            if count == batch_size:
                break
        missing = batch_size - count
        if missing:
            if reserve is None and count == 0:
                images.fill(0 if blank is None else blank)
                labels[:] = 0
            else:
                donor = (
                    reserve
                    if reserve is not None
                    else Batch(images[:count].copy(), labels[:count].copy(), real, 0, ids, keys)
                )
                take = np.arange(missing) % len(donor.labels)
                images[count:] = donor.images[take]
                labels[count:] = donor.labels[take]
            real[count:] = False
            ids[count:] = -1
            keys[count:] = [""] * missing
        batch = Batch(images, labels.copy(), real.copy(), on_error.take_lost(), ids.copy(), keys.copy())
        reserve = batch
        yield batch


def augment_batches(
    batches: Iterable[Batch],
    rng: np.random.Generator | None,
    crop_padding: int,
    hflip: bool,
    on_error: ErrorPolicy | None = None,
    writer: SlotWriter | None = None,
) -> Iterator[dict[str, torch.Tensor | np.ndarray | int | list[str]]]:
    """Augment (when rng is given, i.e. training) and wrap each batch as tensors.

    Images stay uint8: the trainer normalises them on the device. With
    on_error, "bad_shards" lists the shards whose bad data was first met since
    the previous batch (host-only, like "filled" and "sample_id"). With a
    writer the images stay in their slot (augmented there) and the batch
    names it instead ("slot": its batch number in the pass), its fields
    numpy arrays, which travel to the replica inside the message (with rng,
    this stage writes them there; without, the batching stage did).
    Encoded images (data.decode=device) become data.read.encoded's fields.
    """
    for index, batch in enumerate(batches):
        images = batch.images
        if rng is not None:
            images = random_crop_flip(images, crop_padding, hflip, rng)
            if writer is not None:
                # The batching stage kept the unaugmented images, which fill later
                # batches' missing places: the augmented copy goes to the slot.
                writer.region(index)[...] = images
        fields = {
            "label": batch.labels,
            "real": batch.real,
            "sample_id": batch.sample_ids,
            "key": batch.keys,
            "bad_shards": on_error.take_bad_shards() if on_error is not None else [],
        }
        if writer is not None:
            yield {"slot": writer.batch_number(index), "filled": batch.filled, **fields}
            continue
        pixels = pack_encoded(images) if images.dtype == object else {"image": images}
        yield {
            **{name: torch.from_numpy(value) for name, value in pixels.items()},
            "label": torch.from_numpy(fields["label"]),
            "real": torch.from_numpy(fields["real"]),
            "filled": torch.tensor(batch.filled, dtype=torch.int64),
            "sample_id": torch.from_numpy(fields["sample_id"]),
            "key": fields["key"],
            "bad_shards": fields["bad_shards"],
        }


def add_device_draws(
    batches: Iterable[dict[str, torch.Tensor | list[str]]], draws: Callable, epoch: int
) -> Iterator[dict[str, torch.Tensor | list[str]]]:
    """Add the device augmentation's draws (augment.draws.BatchDraws) to each batch, by its sample ids."""
    for batch in batches:
        batch.update(draws(epoch, np.asarray(batch["sample_id"])))
        yield batch
