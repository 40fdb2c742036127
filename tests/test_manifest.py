"""Loading split manifests from folders, manifest URLs and brace patterns."""

from __future__ import annotations

import json
import logging

import pytest

from tests.conftest import numbered_samples
from tpustream import storage
from tpustream.data.format.manifest import (
    MANIFEST_FORMAT,
    ShardInfo,
    ShardManifest,
    summarize_image_sizes,
)
from tpustream.data.resolve.split import load_manifest
from tpustream.errors import ConfigError


@pytest.fixture
def three_shards(write_split) -> str:
    return write_split("train", [numbered_samples(0, 3), numbered_samples(3, 4), numbered_samples(7, 5)])


def test_folder_manifest_url_and_brace_pattern(three_shards):
    whole = load_manifest(three_shards)
    assert whole.num_samples == 12 and [s.samples for s in whole.shards] == [3, 4, 5]
    assert whole.shards[0].url == storage.join(three_shards, "train-000000.tar")
    assert load_manifest(storage.join(three_shards, "manifest.json")).shards == whole.shards
    subset = load_manifest(storage.join(three_shards, "train-{000001..000002}.tar"))
    assert [s.samples for s in subset.shards] == [4, 5] and subset.num_samples == 9
    assert load_manifest(storage.join(three_shards, "train-000002.tar")).num_samples == 5


def test_relative_paths_are_made_absolute(three_shards, monkeypatch):
    monkeypatch.chdir(storage.dirname(three_shards))
    assert load_manifest("train").shards[0].url == storage.join(three_shards, "train-000000.tar")


def test_a_missing_folder_and_a_missing_index_file_name_the_url(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/nowhere: cannot list the shards"):
        load_manifest(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=f"no shard index at {tmp_path}/nowhere/manifest.json"):
        load_manifest(str(tmp_path / "nowhere" / "manifest.json"))


def test_pattern_naming_shards_outside_the_manifest(three_shards):
    with pytest.raises(ConfigError, match=r"1 shard\(s\) not listed.*train-000003\.tar"):
        load_manifest(storage.join(three_shards, "train-{000002..000003}.tar"))


def test_a_folder_manifest_warns_of_shards_it_does_not_list_and_is_where_counts_come_from(
    three_shards, caplog
):
    extra = storage.join(three_shards, "extra-000000.tar")
    storage.write_bytes(extra, storage.read_bytes(storage.join(three_shards, "train-000000.tar")))
    with caplog.at_level(logging.WARNING, logger="tpustream.data.resolve.split"):
        split = load_manifest(three_shards)
    assert split.num_samples == 12 and extra not in [s.url for s in split.shards]
    assert "1 shard file(s) in the folder are not in manifest.json and are NOT read: extra-000000.tar" in (
        caplog.text
    )
    assert "add them to it with their sample counts, or remove it" in caplog.text
    assert split.counts_from == storage.join(three_shards, "manifest.json")


def test_empty_and_invalid_manifests(write_split, tmp_path):
    empty = write_split("val", [[]])
    with pytest.raises(ConfigError, match="has no samples"):
        load_manifest(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tpustream manifest"):
        load_manifest(str(bad))
    (bad / "manifest.json").write_text(json.dumps({"format": "something/else"}))
    with pytest.raises(ConfigError, match="expected 'tpustream.manifest/1'"):
        load_manifest(str(bad))


def test_manifest_in_a_bucket_and_missing_bucket(bucket, write_split):
    folder = write_split("train", [numbered_samples(0, 2)], root=f"{bucket}/data")
    assert load_manifest(folder).num_samples == 2
    with pytest.raises(ConfigError, match="bucket gs://no-such-bucket-xyz does not exist"):
        load_manifest("gs://no-such-bucket-xyz/data/train")
    with pytest.raises(
        ConfigError, match=r"elsewhere/train: no shards \(\*.tar, \*.tar.gz, \*.tgz\) and no manifest.json"
    ):
        load_manifest(f"{bucket}/elsewhere/train")


def test_variable_size_manifest_round_trips(tmp_path):
    folder = str(tmp_path / "train")
    stats = summarize_image_sizes([(375, 500), (500, 333), (64, 4000)])
    assert stats == {"count": 3, "min": [64, 333], "max": [500, 4000], "mean": [313.0, 1611.0]}
    manifest = ShardManifest(
        split="train",
        classes=["a", "b"],
        image_size=None,
        channels=3,
        image_format="mixed",
        shards=[ShardInfo(storage.join(folder, "train-000000.tar"), 3)],
        size_stats=stats,
    )
    text = manifest.to_json(folder)
    doc = json.loads(text)
    assert doc["image_size"] is None and doc["image_sizes"] == stats
    again = ShardManifest.from_json(text, folder, "test")
    assert again == manifest and again.to_json(folder) == text


def test_fixed_size_manifests_without_size_stats_still_read(three_shards):
    text = storage.read_bytes(storage.join(three_shards, "manifest.json")).decode()
    manifest = ShardManifest.from_json(text, three_shards, "test")
    assert manifest.image_size == (8, 8) and manifest.size_stats is None
    assert json.loads(manifest.to_json(three_shards)) == json.loads(text)


def test_malformed_size_stats_are_refused(tmp_path):
    doc = {
        "format": MANIFEST_FORMAT,
        "split": "train",
        "classes": ["a"],
        "image_size": None,
        "image_sizes": {"count": 1, "min": [1], "max": [1, 1], "mean": [1, 1]},
        "channels": 3,
        "image_format": "jpg",
        "shards": [],
    }
    with pytest.raises(ConfigError, match="not a valid tpustream manifest"):
        ShardManifest.from_json(json.dumps(doc), str(tmp_path), "test")
