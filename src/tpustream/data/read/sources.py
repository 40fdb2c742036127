"""Where a stream's samples come from: the shards, read every epoch, or the split held in shared memory.

``ShardStream`` chooses one at construction; each gives the reading and the
decoding stage of the pipeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from tpustream.config import OnError
from tpustream.data.format.decode import ImageDecoder
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import SampleSpan
from tpustream.data.read.memory import (
    SplitMemory,
    load_split_memory,
    read_memory_samples,
    take_memory_samples,
)
from tpustream.data.read.stages import ErrorPolicy, decode_samples, read_span_samples

SampleDecoder = Callable[[dict], tuple[np.ndarray, int]]


class StreamedSamples:
    """Samples read from the shards and decoded in the worker, every epoch."""

    def __init__(self, manifest: ShardManifest):
        self.shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
        self.shard_counts = [shard.samples for shard in manifest.shards]

    def read(self, on_error: ErrorPolicy) -> Callable[[Iterable[SampleSpan]], Iterator]:
        return functools.partial(
            read_span_samples, on_error=on_error, shard_index=self.shard_index, shard_counts=self.shard_counts
        )

    def decode(self, on_error: ErrorPolicy, decoder: SampleDecoder) -> Callable[[Iterable], Iterator]:
        return functools.partial(decode_samples, decoder=decoder, on_error=on_error)


class MemorySamples:
    """Samples looked up in the split decoded once into shared memory.

    Bad samples were reported when the split was loaded, not again here
    (but counted, every pass).
    """

    def __init__(self, manifest: ShardManifest, decoder: ImageDecoder, on_error: OnError):
        self.shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
        self.memory: SplitMemory = load_split_memory(manifest, decoder, ErrorPolicy(on_error))

    def read(self, on_error: ErrorPolicy) -> Callable[[Iterable[SampleSpan]], Iterator]:
        return functools.partial(
            read_memory_samples, memory=self.memory, shard_index=self.shard_index, on_error=on_error
        )

    def decode(self, on_error: ErrorPolicy, decoder: SampleDecoder) -> Callable[[Iterable], Iterator]:
        return functools.partial(take_memory_samples, memory=self.memory, on_error=on_error)
