"""Property tests of the epoch plan and the replica/worker splitters (no XLA, no I/O)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpustream.data.format.manifest import ShardInfo
from tpustream.data.read.layout import (
    CanonicalPartition,
    SampleSpan,
    describe_sharing,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    stream_spans,
    take_range,
    worker_batches,
)
from tpustream.data.read.partition import choose_partition, describe_balance, worker_balance
from tpustream.errors import ConfigError


def expand(spans: list[SampleSpan]) -> list[tuple[str, int, bool]]:
    return [(s.url, i, s.padding) for s in spans for i in range(s.start, s.stop)]


shard_sizes = st.lists(st.integers(0, 300), min_size=1, max_size=40).filter(lambda s: sum(s) > 0)


def make_shards(sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"mem://shard-{i:04d}.tar", n) for i, n in enumerate(sizes)]


def all_samples(shards: list[ShardInfo]) -> set[tuple[str, int]]:
    return {(s.url, i) for s in shards for i in range(s.samples)}


@settings(max_examples=300, deadline=None)
@given(
    sizes=shard_sizes,
    world=st.integers(1, 256),
    workers=st.integers(0, 16),
    batch=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    epoch=st.integers(0, 100),
)
def test_pad_policy_every_replica_and_worker_gets_exact_full_batches(
    sizes, world, workers, batch, seed, epoch
):
    shards = make_shards(sizes)
    n = sum(sizes)
    layout = plan_layout(n, batch, world, "pad")
    assert layout.steps == -(-n // (batch * world))
    ordered = order_shards(shards, seed, epoch, shuffle=True)
    seen: Counter = Counter()
    padding = 0
    effective_workers = max(workers, 1)
    for rank in range(world):
        replica = split_by_replica(ordered, layout, rank)
        assert sum(len(s) for s in replica) == layout.steps * batch
        per_worker = [split_by_worker(replica, batch, w, workers) for w in range(effective_workers)]
        counts = [sum(len(s) for s in spans) for spans in per_worker]
        # Whole batches per worker, summing to the replica's steps, balanced to one batch.
        assert all(c % batch == 0 for c in counts)
        assert sum(counts) // batch == layout.steps
        assert max(counts) - min(counts) <= batch
        # Workers partition the replica's sequence in order.
        assert [x for spans in per_worker for x in expand(spans)] == expand(replica)
        for url, index, is_padding in expand(replica):
            if is_padding:
                padding += 1
            else:
                seen[(url, index)] += 1
    # Every sample exactly once per epoch across the pod; padding is what fills the last global batch.
    assert set(seen) == all_samples(shards)
    assert set(seen.values()) == {1}
    assert padding == layout.padded_samples == layout.steps * batch * world - n


@settings(max_examples=200, deadline=None)
@given(sizes=shard_sizes, world=st.integers(1, 64), workers=st.integers(0, 8), batch=st.integers(1, 32))
def test_drop_policy_sees_each_sample_at_most_once_and_no_padding(sizes, world, workers, batch):
    shards = make_shards(sizes)
    n = sum(sizes)
    if n < batch * world:
        with pytest.raises(ConfigError, match="larger than"):
            plan_layout(n, batch, world, "drop")
        return
    layout = plan_layout(n, batch, world, "drop")
    assert layout.steps == n // (batch * world)
    seen: Counter = Counter()
    for rank in range(world):
        replica = split_by_replica(shards, layout, rank)
        for w in range(max(workers, 1)):
            for url, index, is_padding in expand(split_by_worker(replica, batch, w, workers)):
                assert not is_padding
                seen[(url, index)] += 1
    assert set(seen.values()) <= {1}
    assert sum(seen.values()) == layout.steps * batch * world
    assert layout.dropped_samples == n - sum(seen.values())


@settings(max_examples=100, deadline=None)
@given(sizes=shard_sizes, seed=st.integers(0, 1000), epoch=st.integers(0, 1000))
def test_shard_order_is_a_reproducible_permutation(sizes, seed, epoch):
    shards = make_shards(sizes)
    first = order_shards(shards, seed, epoch, shuffle=True)
    assert first == order_shards(shards, seed, epoch, shuffle=True)
    assert sorted(first, key=lambda s: s.url) == shards
    assert order_shards(shards, seed, epoch, shuffle=False) == shards


def test_shard_order_differs_between_epochs_and_seeds():
    shards = make_shards([10] * 20)
    orders = {tuple(s.url for s in order_shards(shards, 0, epoch, shuffle=True)) for epoch in range(5)}
    assert len(orders) == 5
    assert order_shards(shards, 1, 0, True) != order_shards(shards, 2, 0, True)


def test_take_range_wraps_around_and_flags_padding():
    shards = make_shards([3, 0, 2])
    spans = take_range(shards, 4, 9)
    assert expand(spans) == [
        ("mem://shard-0002.tar", 1, False),
        ("mem://shard-0000.tar", 0, True),
        ("mem://shard-0000.tar", 1, True),
        ("mem://shard-0000.tar", 2, True),
        ("mem://shard-0002.tar", 0, True),
    ]


def test_worker_batches_sum_to_steps():
    for steps in range(0, 40):
        for workers in range(1, 17):
            counts = [worker_batches(steps, w, workers) for w in range(workers)]
            assert sum(counts) == steps and max(counts) - min(counts) <= 1


def test_plan_layout_rejects_bad_input():
    with pytest.raises(ConfigError, match="no samples"):
        plan_layout(0, 8, 1, "pad", "train")
    with pytest.raises(ConfigError, match="batch_size"):
        plan_layout(10, 0, 1)
    with pytest.raises(ConfigError, match="last_batch"):
        plan_layout(10, 2, 1, "wrap")
    with pytest.raises(ValueError, match="rank"):
        split_by_replica(make_shards([10]), plan_layout(10, 2, 2), 2)


def test_describe_sharing_only_when_there_are_fewer_shards_than_readers():
    assert describe_sharing(8, 2, 2) is None
    assert describe_sharing(8, 4, 0) is None
    note = describe_sharing(3, 2, 2)
    # Under a canonical partition the readers are its streams, whatever the workers.
    assert describe_sharing(8, 2, 2, CanonicalPartition(8, 10)) is None
    note = describe_sharing(8, 1, 0, CanonicalPartition(16, 10))
    assert note is not None and note.startswith("8 shard(s) for 16 canonical streams")
    note = describe_sharing(3, 2, 2)
    assert note is not None and "3 shard(s)" in note and "4 readers" in note


# The canonical partition: streams, and which reader reads which.


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def partitioned_epochs(draw):
    """(shard sizes, global batch, streams) with streams dividing the global batch."""
    sizes = draw(shard_sizes)
    global_batch = draw(st.integers(1, 96))
    streams = draw(st.sampled_from(divisors(global_batch)))
    return sizes, global_batch, streams


@settings(max_examples=200, deadline=None)
@given(epoch=partitioned_epochs(), seed=st.integers(0, 2**16), last_batch=st.sampled_from(["pad", "drop"]))
def test_canonical_streams_cover_the_epoch_exactly_once_and_every_shape_reads_each_stream_once(
    epoch, seed, last_batch
):
    sizes, global_batch, streams = epoch
    shards = make_shards(sizes)
    n = sum(sizes)
    if last_batch == "drop" and n < global_batch:
        return
    partition = CanonicalPartition(streams, 16)
    # The layout (steps) depends on the global batch only, so any shape has it.
    layout = plan_layout(n, global_batch, 1, last_batch)
    ordered = order_shards(shards, seed, 0, shuffle=True)
    chunk = partition.stream_batch(global_batch)
    per_stream = [stream_spans(ordered, layout, partition, c) for c in range(streams)]
    assert all(sum(len(s) for s in spans) == layout.steps * chunk for spans in per_stream)
    seen = Counter((url, i) for spans in per_stream for url, i, padding in expand(spans) if not padding)
    assert set(seen.values()) <= {1}
    assert sum(seen.values()) == n - layout.dropped_samples
    # Every shape the partition allows: each stream read by exactly one reader, and a
    # replica's streams, in its workers' order, are its slice of the global batch.
    for world in partition.allowed_replicas():
        per_replica = streams // world
        for workers in range(0, per_replica + 1):
            partition.check_shape(world, global_batch // world, workers)
            order = [
                c
                for rank in range(world)
                for worker in range(max(workers, 1))
                for c in partition.streams_of(rank, world, worker, workers)
            ]
            assert order == list(range(streams))
            assert all(
                partition.streams_of(rank, world, worker, workers)
                for rank in range(world)
                for worker in range(max(workers, 1))
            )


def test_a_shape_the_partition_does_not_allow_is_refused_naming_what_fits():
    partition = CanonicalPartition(8, 100)
    partition.check_shape(2, 32, 4)
    with pytest.raises(ConfigError, match=r"3 replica\(s\) cannot share .* 1, 2, 4, 8 replica"):
        partition.check_shape(3, 32, 1)
    with pytest.raises(ConfigError, match="data.num_workers=3 .* at most 2"):
        partition.check_shape(4, 16, 3)
    with pytest.raises(ConfigError, match="global batch they divide"):
        partition.check_shape(2, 3, 1)


@pytest.mark.parametrize(
    ("world", "batch", "workers", "shards", "expected"),
    [
        (4, 16, 2, 1000, 4 * 8),  # up to 4 streams a worker, one shard each at least
        (4, 16, 2, 6, 4 * 2),  # few shards: the fewest streams that give each worker one
        (2, 12, 0, 100, 2 * 4),  # the largest divisor of the batch within 4 per reader
        (1, 7, 2, 100, 7),
        (8, 1, 0, 100, 8),
    ],
)
def test_auto_partition_gives_each_reader_a_few_streams_within_the_batch_and_shards(
    world, batch, workers, shards, expected
):
    partition = choose_partition("auto", world, batch, workers, shards, 2000)
    assert partition is not None and partition.streams == expected
    # A reader holds the shuffle buffer it holds without a partition, over its streams.
    per_reader = expected // (world * max(workers, 1))
    assert partition.stream_buffer == -(-2000 // per_reader)


def test_no_partition_where_none_fits_or_when_asked_for_none():
    assert choose_partition("auto", 4, 1, 2, 100, 100) is None  # one sample a replica, two workers
    assert choose_partition(0, 4, 16, 2, 100, 100) is None
    assert choose_partition(16, 4, 16, 2, 100, 100) == CanonicalPartition(16, 50)
    with pytest.raises(ConfigError, match="3 replica"):
        choose_partition(16, 3, 16, 0, 100, 100)


@pytest.mark.parametrize(
    ("workers", "expected", "balance"),
    [
        (8, 16, 1.0),  # 8 divides 16: 2 each
        (16, 16, 1.0),
        (15, 128, 128 / 15 / 9),  # 16 would leave one worker two streams and 14 one: 0.53
        (14, 64, 64 / 14 / 5),
        (12, 128, 128 / 12 / 11),
    ],
)
def test_auto_partition_shares_the_streams_evenly_over_workers_that_do_not_divide_the_batch(
    workers, expected, balance
):
    """ResNet-50's batch of 256 on a 16-vCPU host: every batch waits for the worker with the most streams."""
    partition = choose_partition("auto", 1, 256, workers, 26, 5000)
    assert partition is not None and partition.streams == expected
    assert worker_balance(expected, workers) == pytest.approx(balance)
    assert worker_balance(16, 15) == pytest.approx(16 / 15 / 2)
    assert describe_balance(partition, 1, workers) is None


def test_uneven_shares_are_said_with_the_worker_count_that_shares_evenly():
    text = describe_balance(CanonicalPartition(16, 100), 1, 15)
    assert text is not None and "busiest reads 2" in text and "53%" in text and "8 worker(s)" in text
