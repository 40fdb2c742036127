"""Our replica and worker splitters as nodesplitter= / workersplitter= of a plain webdataset.WebDataset."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import webdataset as wds
from torch.utils.data import DataLoader

from tests.conftest import write_wds_shards
from tpustream.data.read.splitters import ReplicaSplitter, WorkerSplitter
from tpustream.errors import ConfigError


@pytest.fixture
def eleven_shards(tmp_path) -> list[str]:
    folder = tmp_path / "wds"
    names = write_wds_shards(str(folder), "s-%06d.tar", 55, maxcount=5, image_field="png")
    return [str(folder / n) for n in names]


def keys_of(urls: list[str], rank: int, world: int, workers: int) -> list[str]:
    dataset = wds.WebDataset(
        urls,
        nodesplitter=ReplicaSplitter(rank, world),
        workersplitter=WorkerSplitter(),
        shardshuffle=False,
        empty_check=False,
    ).to_tuple("__key__")
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return [key for (key,) in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_replica_gets_as_many_shards_each_shard_once(eleven_shards, workers, caplog):
    world = 3
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.splitters"):
        per_replica = [keys_of(eleven_shards, rank, world, workers) for rank in range(world)]
    assert [len(keys) for keys in per_replica] == [15, 15, 15]  # 3 shards x 5 samples each
    seen = Counter(k for keys in per_replica for k in keys)
    assert set(seen.values()) == {1} and len(seen) == 45
    assert sorted(seen) == [f"{i:07d}" for i in range(45)]  # the last 2 of 11 shards left out
    if workers == 0:
        assert "2 of 11 shards left out so that each of 3 replicas gets 3" in caplog.text


def test_too_few_shards_for_the_replicas_is_an_error(eleven_shards):
    with pytest.raises(ConfigError, match="2 shard\\(s\\) for 4 replicas"):
        list(ReplicaSplitter(0, 4)({"url": u} for u in eleven_shards[:2]))


def test_the_replica_defaults_to_the_environment(monkeypatch, eleven_shards):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    urls = [s["url"] for s in ReplicaSplitter()({"url": u} for u in eleven_shards)]
    assert urls == eleven_shards[1:10:2]
