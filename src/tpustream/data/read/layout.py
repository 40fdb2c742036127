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

That order depends on the readers (replicas x workers). Training runs use a
**canonical partition** instead (``CanonicalPartition``), chosen when a run
starts and kept in its checkpoints: the virtual sequence is cut into C
canonical streams, each one contiguous range with its own shuffle buffer, and
global step s takes the next ``global_batch / C`` samples of every stream, in
stream order. Replica r reads streams [r C/R, (r+1) C/R) and its workers split
those, so the samples of every global step, and their order in it, depend on
(seed, epoch, shards, global batch, C) only: a run stopped on one shape
continues on any other with R dividing C and at most C/R workers per replica.
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
    """How many steps every replica runs and how many real samples they cover.

    Attributes:
        steps: steps per epoch, the same on every replica.
        batch_size: each replica's batch.
        world_size: the replicas.
        num_samples: the split's samples.
        last_batch: ``pad`` or ``drop``, as planned.
    """

    steps: int
    batch_size: int
    world_size: int
    num_samples: int
    last_batch: LastBatch

    @property
    def samples_per_replica(self) -> int:
        """Samples each replica reads per epoch, padding included."""
        return self.steps * self.batch_size

    @property
    def global_batch_size(self) -> int:
        """Samples one step takes over all replicas."""
        return self.batch_size * self.world_size

    @property
    def padded_samples(self) -> int:
        """Repeated samples that fill the last global batch (``pad``); they weigh zero."""
        return max(0, self.steps * self.global_batch_size - self.num_samples)

    @property
    def dropped_samples(self) -> int:
        """Samples left out because they cannot fill a global batch (``drop``)."""
        return max(0, self.num_samples - self.steps * self.global_batch_size)


def plan_layout(
    num_samples: int,
    batch_size: int,
    world_size: int,
    last_batch: LastBatch | str = LastBatch.pad,
    split: str = "",
) -> EpochLayout:
    """Steps per epoch for a split; identical on every replica by construction.

    Args:
        num_samples: the split's samples (``ShardManifest.num_samples``).
        batch_size: each replica's batch.
        world_size: the replicas.
        last_batch: ``pad`` fills the last global batch with the epoch's first
            samples, marked not real (they weigh zero); ``drop`` leaves the
            samples that cannot fill one out.
        split: the split's name, for errors.

    Raises:
        ConfigError: batch_size or world_size below 1, an unknown last_batch, no
            samples, or (``drop``) a global batch larger than the split.
    """
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


@dataclass(frozen=True)
class CanonicalPartition:
    """An epoch cut into canonical streams: the training order's only dependence on the job's shape.

    streams: C, the number of streams (a divisor of the global batch);
    stream_buffer: samples each stream's shuffle buffer holds.
    """

    streams: int
    stream_buffer: int

    def as_dict(self) -> dict[str, int]:
        return {"streams": self.streams, "stream_buffer": self.stream_buffer}

    @classmethod
    def from_dict(cls, plan: dict | None) -> CanonicalPartition | None:
        """The partition a checkpoint's data_plan records (None: an older, per-reader plan)."""
        if not plan or not plan.get("streams"):
            return None
        return cls(int(plan["streams"]), int(plan["stream_buffer"]))

    def stream_batch(self, global_batch: int) -> int:
        """Samples each stream gives every global step."""
        return global_batch // self.streams

    def per_replica(self, world_size: int) -> int:
        """Streams each of world_size replicas reads: also the most workers a replica may have."""
        return self.streams // world_size

    def streams_of(self, rank: int, world_size: int, worker: int, workers: int) -> range:
        """The streams replica `rank`'s worker `worker` reads: its replica's, split in order.

        The replica's C/R streams are its batch, in order; its workers take
        contiguous runs of them (the first ones one more when they do not divide).
        """
        per_replica = self.per_replica(world_size)
        workers = max(workers, 1)
        base, extra = divmod(per_replica, workers)
        first = rank * per_replica + worker * base + min(worker, extra)
        return range(first, first + base + (1 if worker < extra else 0))

    def check_shape(self, world_size: int, replica_batch: int, workers: int) -> None:
        """ConfigError unless a run with this shape can read the partition (before spawning where known)."""
        global_batch = replica_batch * world_size
        allowed = self.allowed_replicas()
        if global_batch % self.streams:
            raise ConfigError(
                f"the run's {self.streams} canonical streams need a global batch they divide; "
                f"batch_size gives {replica_batch} x {world_size} replica(s) = {global_batch}: keep the "
                "global batch the run started with"
            )
        if self.streams % world_size:
            raise ConfigError(
                f"{world_size} replica(s) cannot share the run's {self.streams} canonical streams evenly: "
                f"it continues on {', '.join(map(str, allowed))} replica(s)"
            )
        per_replica = self.per_replica(world_size)
        if max(workers, 1) > per_replica:
            raise ConfigError(
                f"data.num_workers={workers} is more than the {per_replica} canonical stream(s) each of "
                f"{world_size} replica(s) reads: set data.num_workers to at most {per_replica}"
            )

    def allowed_replicas(self) -> list[int]:
        return [r for r in range(1, self.streams + 1) if self.streams % r == 0]


def stream_spans(
    ordered_shards: Sequence[ShardInfo], layout: EpochLayout, partition: CanonicalPartition, stream: int
) -> list[SampleSpan]:
    """The contiguous range of the epoch's sample sequence that canonical stream `stream` holds."""
    length = layout.steps * partition.stream_batch(layout.global_batch_size)
    return take_range(ordered_shards, stream * length, (stream + 1) * length)


def describe_sharing(
    num_shards: int, world_size: int, workers: int, partition: CanonicalPartition | None = None
) -> str | None:
    """A start-up note when there are too few shards for one reader (canonical stream) each."""
    if partition is not None:
        if num_shards >= partition.streams:
            return None
        return (
            f"{num_shards} shard(s) for {partition.streams} canonical streams: splitting by sample "
            "ranges, so streams share shards and skip each other's samples; write more shards for "
            "fully parallel reads"
        )
    slots = world_size * max(workers, 1)
    if num_shards >= slots:
        return None
    return (
        f"{num_shards} shard(s) for {world_size} replica(s) x {max(workers, 1)} worker(s) = "
        f"{slots} readers: splitting by sample ranges, so readers share shards and skip "
        "each other's samples; write more shards for fully parallel reads"
    )
