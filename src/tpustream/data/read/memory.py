"""A split read and decoded once into shared memory, served as the streamed stages would serve it.

With data.in_memory, the reading and decoding stages are replaced by lookups
here (``read_memory_samples``, ``take_memory_samples``); the other stages are
the same, so the batches are identical to the streamed ones, bad data included.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tpustream import progress
from tpustream.data.format.decode import ImageDecoder, SampleError
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import SampleSpan
from tpustream.data.read.stages import SHARD_ID_SHIFT, DecodedSample, ErrorPolicy, read_span_samples
from tpustream.errors import ConfigError

log = logging.getLogger(__name__)


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
    # Each row's __key__: a list each worker gets a copy of (tens of bytes a
    # sample, beside the image's thousands).
    keys: list[str]

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
    keys: list[str] = []
    spans = [SampleSpan(shard.url, 0, shard.samples) for shard in manifest.shards]
    for sample in read_span_samples(spans, on_error, shard_index, [s.samples for s in manifest.shards]):
        shard, index = sample["__id__"] >> SHARD_ID_SHIFT, sample["__index__"]
        progress.beat("a sample read into memory")  # a large split takes minutes to load
        delivered[shard] = index + 1
        try:
            image_rows[count], labels[count] = decoder(sample)
        except SampleError as exc:
            on_error(sample["__url__"], sample["__key__"], str(exc))
            continue
        rows[shard_starts[shard] + index] = count
        keys.append(sample["__key__"])
        count += 1
    if count < listed:
        images = share_tensor(images[:count].clone(), manifest.split)
    memory = SplitMemory(
        images,
        share_tensor(torch.from_numpy(labels[:count].copy()), manifest.split),
        share_tensor(torch.from_numpy(rows), manifest.split),
        shard_starts,
        delivered,
        keys,
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
    spans: Iterable[SampleSpan], memory: SplitMemory, shard_index: dict[str, int], on_error: ErrorPolicy
) -> Iterator[SampleRef]:
    """References to the samples of each span, as read_span_samples would yield them.

    A span stops where its shard's reader stopped when the split was loaded
    (a truncated shard ends the span early, as streaming does, and its missing
    real samples are counted at the same point). Samples that failed to decode
    stay in, with row -1, because the shuffle draws and the resume skip count
    them when streaming; take_memory_samples leaves them out.
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
        if real:
            on_error.count_lost(span.stop - max(stop, span.start))


def take_memory_samples(
    refs: Iterable[SampleRef], memory: SplitMemory, on_error: ErrorPolicy
) -> Iterator[DecodedSample]:
    """The samples behind the references (views of shared memory), leaving out bad ones.

    Bad samples were reported to the error policy once, when the split was
    loaded; here the real ones are counted, as decode_samples counts them, and
    batch_samples fills their places as it does for streamed ones.
    """
    images = memory.images.numpy()
    labels = memory.labels.numpy()
    for ref in refs:
        if ref.row >= 0:
            yield DecodedSample(
                images[ref.row], int(labels[ref.row]), ref.real, ref.sample_id, memory.keys[ref.row]
            )
        elif ref.real:
            on_error.count_lost()
