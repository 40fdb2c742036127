"""Exact, equal split of an epoch's samples over replicas and DataLoader workers.

The invariant that keeps a pod alive: every replica runs the same number of
steps with the same batch shape, every epoch, whatever the shard sizes. We get
it by planning at the sample level from the manifest's counts:

1. The epoch's shard order is a permutation seeded by (seed, epoch), the same
   on every replica (``order_shards``).
2. That order defines a virtual sequence of all N samples. The pod needs
   ``steps * batch_size * world_size`` positions; with ``last_batch="pad"``
   positions past N wrap around to the start and are flagged as padding,
   with ``"drop"`` the tail that cannot fill a global batch is left out.
3. Replica r takes one contiguous range of positions (``split_by_replica``)
   and its worker w a contiguous run of whole batches of that range
   (``split_by_worker``).

A range boundary may fall inside a shard; both neighbours then read that shard
and skip the other's samples. With at least world_size * workers shards that
is at most one shared shard per boundary; with fewer shards it degrades into
a sample-level split (``describe_sharing`` says so at start).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from tpustream.config import LastBatch
from tpustream.data.format.manifest import ShardInfo
from tpustream.errors import ConfigError


@dataclass(frozen=True)
class SampleSpan:
    """Samples [start, stop) of one shard, in shard order.

    padding marks samples that repeat the start of the epoch to fill the last
    global batch; they keep batch shapes static but are masked out of the loss
    and the metrics.
    """

    url: str
    start: int
    stop: int
    padding: bool = False

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EpochLayout:
    """How many steps every replica runs and how many real samples they cover."""

    steps: int
    batch_size: int
    world_size: int
    num_samples: int
    last_batch: LastBatch

    @property
    def samples_per_replica(self) -> int:
        return self.steps * self.batch_size

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def padded_samples(self) -> int:
        return max(0, self.steps * self.global_batch_size - self.num_samples)

    @property
    def dropped_samples(self) -> int:
        return max(0, self.num_samples - self.steps * self.global_batch_size)


def plan_layout(
    num_samples: int,
    batch_size: int,
    world_size: int,
    last_batch: LastBatch | str = LastBatch.pad,
    split: str = "",
) -> EpochLayout:
    """Steps per epoch for a split; identical on every replica by construction."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if world_size < 1:
        raise ConfigError(f"world size must be positive, got {world_size}")
    try:
        last_batch = LastBatch(last_batch)
    except ValueError:
        choices = ", ".join(p.value for p in LastBatch)
        raise ConfigError(f"data.last_batch must be one of {choices}, got {last_batch!r}") from None
    if num_samples < 1:
        raise ConfigError(f"{split or 'split'} has no samples")
    global_batch = batch_size * world_size
    if last_batch == LastBatch.drop:
        steps = num_samples // global_batch
        if steps == 0:
            raise ConfigError(
                f"batch_size {batch_size} x {world_size} replica(s) = {global_batch} is larger "
                f"than the {num_samples} {split or ''} samples; lower batch_size or use "
                "data.last_batch=pad"
            )
    else:
        steps = -(-num_samples // global_batch)
    return EpochLayout(steps, batch_size, world_size, num_samples, last_batch)


def order_shards(shards: Sequence[ShardInfo], seed: int, epoch: int, shuffle: bool) -> list[ShardInfo]:
    """The epoch's shard order: a (seed, epoch) permutation, or manifest order."""
    shards = list(shards)
    if not shuffle:
        return shards
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    return [shards[i] for i in rng.permutation(len(shards))]


def take_range(shards: Sequence[ShardInfo], start: int, stop: int) -> list[SampleSpan]:
    """Spans covering positions [start, stop) of the concatenated shards.

    Positions at or past the total wrap around to the beginning and are
    marked as padding.
    """
    ends = list(accumulate(s.samples for s in shards))
    total = ends[-1] if ends else 0
    if stop > start and total == 0:
        raise ConfigError("cannot take samples from shards that hold none")
    spans: list[SampleSpan] = []
    pos = start
    while pos < stop:
        lap, offset = divmod(pos, total)
        index = bisect.bisect_right(ends, offset)
        shard_start = ends[index] - shards[index].samples
        take = min(ends[index] - offset, stop - pos)
        first = offset - shard_start
        spans.append(SampleSpan(shards[index].url, first, first + take, padding=lap > 0))
        pos += take
    return spans


def slice_spans(spans: Sequence[SampleSpan], start: int, stop: int) -> list[SampleSpan]:
    """Positions [start, stop) of a list of spans, as spans."""
    out: list[SampleSpan] = []
    pos = 0
    for span in spans:
        lo, hi = max(start, pos), min(stop, pos + len(span))
        if lo < hi:
            first = span.start + lo - pos
            out.append(SampleSpan(span.url, first, first + hi - lo, span.padding))
        pos += len(span)
        if pos >= stop:
            break
    return out


def split_by_replica(ordered_shards: Sequence[ShardInfo], layout: EpochLayout, rank: int) -> list[SampleSpan]:
    """The contiguous range of the epoch's sample sequence that replica `rank` trains on."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside world of size {layout.world_size}")
    q = layout.samples_per_replica
    return take_range(ordered_shards, rank * q, (rank + 1) * q)


def worker_batches(steps: int, worker: int, workers: int) -> int:
    """Batches DataLoader worker `worker` of `workers` produces; they sum to steps."""
    base, extra = divmod(steps, workers)
    return base + (1 if worker < extra else 0)


def split_by_worker(
    replica_spans: Sequence[SampleSpan], batch_size: int, worker: int, workers: int
) -> list[SampleSpan]:
    """A DataLoader worker's whole batches out of its replica's spans.

    Each worker batches on its own, so each gets a multiple of batch_size
    samples; the DataLoader interleaves their batches.
    """
    workers = max(workers, 1)
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} outside {workers} workers")
    total = sum(len(s) for s in replica_spans)
    steps = total // batch_size
    first_batch = sum(worker_batches(steps, w, workers) for w in range(worker))
    count = worker_batches(steps, worker, workers)
    return slice_spans(replica_spans, first_batch * batch_size, (first_batch + count) * batch_size)


def describe_sharing(num_shards: int, world_size: int, workers: int) -> str | None:
    """A start-up note when there are too few shards for one reader each."""
    slots = world_size * max(workers, 1)
    if num_shards >= slots:
        return None
    return (
        f"{num_shards} shard(s) for {world_size} replica(s) x {max(workers, 1)} worker(s) = "
        f"{slots} readers: splitting by sample ranges, so readers share shards and skip "
        "each other's samples; write more shards for fully parallel reads"
    )
