"""Property tests of the epoch plan and the replica/worker splitters (no XLA, no I/O)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpustream.data.format.manifest import ShardInfo
from tpustream.data.read.plan import (
    SampleSpan,
    describe_sharing,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    take_range,
    worker_batches,
)
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
    assert note is not None and "3 shard(s)" in note and "4 readers" in note
