"""Tests of data/counts.py: each tool's metadata written as its upstream writer writes it, then read back."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pytest
import webdataset as wds
import yaml

from tpustream import storage
from tpustream.data.format.tar import iter_shard_samples, write_tar
from tpustream.data.resolve.recorded import (
    CountSource,
    find_recorded_counts,
    read_shard_list,
    read_total_hint,
)
from tpustream.errors import ConfigError


def write_shards(folder: Path, pattern: str, sizes: list[int]) -> list[str]:
    """Shards written by webdataset.ShardWriter, shard i holding sizes[i] samples; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, size in enumerate(sizes):
        # One writer per shard so that shards can differ in size; start_shard names it.
        writer = wds.ShardWriter(str(folder / pattern), maxcount=max(size, 1), start_shard=index, verbose=0)
        for sample in range(size):
            writer.write({"__key__": f"s{index:03d}_{sample:05d}", "cls": str(sample % 10).encode()})
        paths.append(writer.fname)
        writer.close()
    return paths


def count_samples(url: str) -> int:
    """The number of samples a shard really holds, counted by reading it."""
    with storage.open_read(url) as stream:
        return sum(1 for _ in iter_shard_samples(stream, url))


def write_wids_index(path: Path, shards: list[dict], name: str | None = "train", **extra) -> None:
    """A wids index as `widsindex create` (wids/wids_index.py main_create) writes it."""
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shards, **extra}
    if name is not None:
        index["name"] = name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(index, indent=2))


def wids_entry(url: str, shard_path: str) -> dict:
    """A shardlist entry with the fields main_create records, computed from the real shard."""
    data = Path(shard_path).read_bytes()
    return {
        "url": url,
        "md5sum": hashlib.md5(data).hexdigest(),
        "nsamples": count_samples(shard_path),
        "filesize": len(data),
    }


def img2dataset_stats(count: int, successes: int) -> dict:
    """A stats object with the fields of img2dataset/logger.py write_stats."""
    start = time.time()
    return {
        "count": count,
        "successes": successes,
        "failed_to_download": count - successes,
        "failed_to_resize": 0,
        "duration": 1.5,
        "start_time": start,
        "end_time": start + 1.5,
        "status_dict": {"success": successes, "404 Client Error": count - successes},
    }


def write_img2dataset_shard(folder: Path, shard_id: int, outcomes: list[bool], stats: bool = True) -> str:
    """One img2dataset webdataset shard: WebDatasetSampleWriter writes only the successes to the tar.

    outcomes[i] says whether row i downloaded; keys follow downloader.compute_key
    with oom_shard_count 5 (the default) and 10**oom_sample_per_shard rows per shard.
    """
    folder.mkdir(parents=True, exist_ok=True)
    shard_name = f"{shard_id:05d}"
    tar_path = folder / f"{shard_name}.tar"
    with open(tar_path, "wb") as stream:
        writer = wds.TarWriter(stream)
        for row, success in enumerate(outcomes):
            if not success:
                continue
            key = f"{10**2 * shard_id + row:07d}"
            meta = {"url": f"http://example.com/{row}.jpg", "key": key, "status": "success"}
            writer.write(
                {"__key__": key, "jpg": b"\xff\xd8jpeg", "txt": "a caption", "json": json.dumps(meta)}
            )
        writer.close()
    if stats:
        record = img2dataset_stats(len(outcomes), sum(outcomes))
        (folder / f"{shard_name}_stats.json").write_text(json.dumps(record, indent=4))
    return str(tar_path)


def timm_split(name: str, filenames: list[str], lengths: list[int]) -> dict:
    """One split of a timm _info.json, with the keys reader_wds._parse_split_info reads."""
    return {"name": name, "num_samples": sum(lengths), "filenames": filenames, "shard_lengths": lengths}


def only_source(sources: list[CountSource]) -> CountSource:
    assert len(sources) == 1, sources
    return sources[0]


# --- wids ---------------------------------------------------------------------


def test_wids_index_relative_names_resolve_against_the_index_folder(tmp_path):
    shard_paths = write_shards(tmp_path / "shards", "train-%06d.tar", [5, 3, 7])
    # `widsindex update --nodir` leaves bare file names, relative to the index.
    entries = [wids_entry(os.path.basename(p), p) for p in shard_paths]
    write_wids_index(tmp_path / "shards" / "train.json", entries, name="cifar-train")

    shards, description = read_shard_list(str(tmp_path / "shards" / "train.json"))

    assert shards == list(zip(shard_paths, [5, 3, 7], strict=True))
    assert [count_samples(url) for url, _ in shards] == [5, 3, 7]
    assert description == f"wids index {tmp_path / 'shards' / 'train.json'} (dataset 'cifar-train')"


def test_wids_index_relative_path_of_the_index_itself(tmp_path, monkeypatch):
    shard_paths = write_shards(tmp_path / "shards", "train-%06d.tar", [2])
    write_wids_index(tmp_path / "shards" / "train.json", [wids_entry("train-000000.tar", shard_paths[0])])
    monkeypatch.chdir(tmp_path)

    shards, _ = read_shard_list("shards/train.json")

    # Replicas do not share a working directory: shard URLs come back absolute.
    assert shards == [(shard_paths[0], 2)]


def test_wids_index_relative_absolute_and_full_urls(tmp_path):
    shard_paths = write_shards(tmp_path / "shards", "part-%06d.tar", [4, 6, 1])
    entries = [
        wids_entry("../shards/part-000000.tar", shard_paths[0]),  # climbs out of the index folder
        wids_entry(shard_paths[1], shard_paths[1]),  # an absolute path is kept
        {"url": "gs://other-bucket/x/part-9.tar", "nsamples": 11},  # a full URL is kept
        wids_entry("./more/../../shards/part-000002.tar", shard_paths[2]),  # normalised
    ]
    write_wids_index(tmp_path / "indexes" / "mixed.json", entries, name=None)

    shards, description = read_shard_list(str(tmp_path / "indexes" / "mixed.json"))

    assert shards == [
        (shard_paths[0], 4),
        (shard_paths[1], 6),
        ("gs://other-bucket/x/part-9.tar", 11),
        (shard_paths[2], 1),
    ]
    assert description == f"wids index {tmp_path / 'indexes' / 'mixed.json'}"


def test_wids_index_without_counts_still_lists_shards(tmp_path):
    # wids itself requires nsamples; the list is usable when counts come from elsewhere.
    write_wids_index(tmp_path / "i.json", [{"url": "a.tar"}, {"url": "b.tar", "nsamples": None}])

    shards, _ = read_shard_list(str(tmp_path / "i.json"))

    assert shards == [(str(tmp_path / "a.tar"), None), (str(tmp_path / "b.tar"), None)]


def test_wids_sub_datasets_by_source_url_and_inline_base(tmp_path):
    # resolve_dsdesc: a source_url component resolves against its own folder,
    # an inline component against its "base", the top level against the index.
    write_wids_index(tmp_path / "remote" / "sub.json", [{"url": "s0.tar", "nsamples": 3}], name="sub")
    write_wids_index(
        tmp_path / "top" / "all.json",
        [{"url": "t0.tar", "nsamples": 1}],
        datasets=[
            {"source_url": str(tmp_path / "remote" / "sub.json"), "weight": 2.0},
            {"name": "inline", "base": "gs://bkt/inline", "shardlist": [{"url": "i0.tar", "nsamples": 9}]},
        ],
    )

    shards, _ = read_shard_list(str(tmp_path / "top" / "all.json"))

    assert shards == [
        (str(tmp_path / "top" / "t0.tar"), 1),
        (str(tmp_path / "remote" / "s0.tar"), 3),
        ("gs://bkt/inline/i0.tar", 9),
    ]


@pytest.mark.parametrize(
    "document",
    [
        {"format": "tpustream.manifest/1", "split": "train", "shards": [{"name": "a.tar", "samples": 3}]},
        ["a.tar", "b.tar"],
        {"__kind__": "something-else", "files": []},
    ],
    ids=["tpustream-manifest", "json-list", "other-kind"],
)
def test_read_shard_list_leaves_other_json_to_the_caller(tmp_path, document):
    (tmp_path / "x.json").write_text(json.dumps(document))

    assert read_shard_list(str(tmp_path / "x.json")) is None


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": []}), "wids_version is None"),
        (
            json.dumps({"__kind__": "wids-shard-index-v2", "wids_version": 1}),
            "__kind__ is 'wids-shard-index-v2'",
        ),
        (
            json.dumps({"wids_version": 2, "shardlist": [{"url": "a.tar", "nsamples": 1}]}),
            "wids_version is 2",
        ),
        (json.dumps({"wids_version": 1, "shardlist": {"url": "a.tar"}}), "shardlist is an object"),
        (json.dumps({"wids_version": 1, "shardlist": [{"nsamples": 1}]}), "shardlist[0] has no 'url'"),
        (
            json.dumps({"wids_version": 1, "shardlist": [{"url": "a", "nsamples": -1}]}),
            "negative sample count",
        ),
        (json.dumps({"wids_version": 1, "shardlist": [{"url": "a", "nsamples": "9"}]}), "nsamples is '9'"),
        (json.dumps({"wids_version": 1, "shardlist": [{"url": "a", "nsamples": True}]}), "nsamples is True"),
        (json.dumps({"wids_version": 1, "shardlist": [{"url": "a", "nsamples": 2.5}]}), "nsamples is 2.5"),
        (json.dumps({"wids_version": 1, "shardlist": []}), "lists no shards"),
        (json.dumps({"wids_version": 1, "datasets": [{"name": "x"}]}), "datasets[0] has no 'shardlist'"),
    ],
)
def test_malformed_wids_index_names_the_file(tmp_path, text, complaint):
    path = tmp_path / "bad-index.json"
    path.write_text(text)

    with pytest.raises(ConfigError) as error:
        read_shard_list(str(path))

    message = str(error.value)
    assert str(path) in message and complaint in message and "\n" not in message


def test_missing_wids_index_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the shard list .*missing.json"):
        read_shard_list(str(tmp_path / "missing.json"))


# --- open_clip ----------------------------------------------------------------


def test_open_clip_sizes_json_maps_file_names_to_counts(tmp_path):
    folder = tmp_path / "laion"
    paths = write_shards(folder, "%05d.tar", [4, 2, 6])
    # get_dataset_size does int(sizes[basename]): counts may be written as text.
    sizes = {"00000.tar": 4, "00001.tar": "2", "00002.tar": 6, "00099.tar": 1000}
    (folder / "sizes.json").write_text(json.dumps(sizes))
    (folder / "__len__").write_text("1012\n")

    source = only_source(find_recorded_counts(paths[:2]))

    assert source.counts == {paths[0]: 4, paths[1]: 2}
    assert source.counts == {p: count_samples(p) for p in paths[:2]}
    assert source.description == f"sizes.json (open_clip) in {folder}"
    assert read_total_hint(str(folder)) == 1012


def test_open_clip_total_hint_is_absent_without_len_file(tmp_path):
    assert read_total_hint(str(tmp_path)) is None


@pytest.mark.parametrize("text", ["abc", "-5", "12.5", "[1, 2]", "__import__('os')"])
def test_malformed_open_clip_len_names_the_file(tmp_path, text):
    (tmp_path / "__len__").write_text(text)

    with pytest.raises(ConfigError, match=f"^{tmp_path / '__len__'}: "):
        read_total_hint(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{", "not valid JSON"),
        ("[4, 2]", "a list, expected an object"),
        ('{"00000.tar": -4}', "'00000.tar' is -4, a negative sample count"),
        ('{"00000.tar": 4, "other.tar": {"n": 1}}', "'other.tar' is {'n': 1}"),
        ('{"00000.tar": NaN}', "'00000.tar' is nan"),
    ],
)
def test_malformed_sizes_json_names_the_file(tmp_path, text, complaint):
    paths = write_shards(tmp_path, "%05d.tar", [4])
    (tmp_path / "sizes.json").write_text(text)

    with pytest.raises(ConfigError) as error:
        find_recorded_counts(paths)

    message = str(error.value)
    assert message.startswith(str(tmp_path / "sizes.json")) and complaint in message and "\n" not in message


# --- timm ---------------------------------------------------------------------


def write_timm_dataset(folder: Path) -> tuple[list[str], list[str]]:
    """Train and validation shards in one folder with their _info.json, as timm's wds datasets ship."""
    train = write_shards(folder, "imagenet-train-%04d.tar", [5, 5, 3])
    validation = write_shards(folder, "imagenet-validation-%04d.tar", [2, 4])
    info = {
        "name": "imagenet",
        "splits": {
            "train": timm_split("train", [os.path.basename(p) for p in train], [5, 5, 3]),
            "validation": timm_split("validation", [os.path.basename(p) for p in validation], [2, 4]),
        },
    }
    (folder / "_info.json").write_text(json.dumps(info, indent=2))
    return train, validation


def test_timm_info_picks_the_split_that_lists_the_shards(tmp_path):
    train, validation = write_timm_dataset(tmp_path / "imagenet")

    source = only_source(find_recorded_counts(validation))

    assert source.counts == {validation[0]: 2, validation[1]: 4}
    assert source.counts == {p: count_samples(p) for p in validation}
    assert source.description == f"_info.json (timm) in {tmp_path / 'imagenet'}, split validation"

    both = only_source(find_recorded_counts([train[2], validation[0]]))
    assert both.counts == {train[2]: 3, validation[0]: 2}
    assert both.description.endswith("split train, validation")


def test_timm_split_that_lists_most_shards_wins_a_shared_file_name(tmp_path):
    paths = write_shards(tmp_path, "shard-%02d.tar", [3, 3])
    info = {
        "splits": {
            "subset": timm_split("subset", ["shard-00.tar"], [99]),
            "full": timm_split("full", ["shard-00.tar", "shard-01.tar"], [3, 3]),
        }
    }
    (tmp_path / "_info.json").write_text(json.dumps(info))

    assert only_source(find_recorded_counts(paths)).counts == {paths[0]: 3, paths[1]: 3}


def test_timm_yaml_info_of_older_timm(tmp_path):
    paths = write_shards(tmp_path, "ds-train-%04d.tar", [2, 3])
    info = {"splits": {"train": timm_split("train", [os.path.basename(p) for p in paths], [2, 3])}}
    (tmp_path / "info.yaml").write_text(yaml.safe_dump(info))

    source = only_source(find_recorded_counts(paths))

    assert source.counts == {paths[0]: 2, paths[1]: 3}
    assert source.description.startswith("info.yaml (timm)")


def test_timm_underscore_info_is_preferred_as_timm_does(tmp_path):
    paths = write_shards(tmp_path, "ds-train-%04d.tar", [2])
    (tmp_path / "_info.json").write_text(
        json.dumps({"splits": {"train": timm_split("train", ["ds-train-0000.tar"], [2])}})
    )
    (tmp_path / "info.json").write_text(
        json.dumps({"splits": {"train": timm_split("train", ["ds-train-0000.tar"], [7])}})
    )

    assert only_source(find_recorded_counts(paths)).counts == {paths[0]: 2}


def test_timm_split_without_filenames_gives_no_per_shard_counts(tmp_path):
    # timm then takes the shard names from the split spec (`...-{0000..0001}.tar|5`).
    paths = write_shards(tmp_path, "ds-train-%04d.tar", [2, 3])
    (tmp_path / "_info.json").write_text(
        json.dumps({"splits": {"train": {"name": "train", "num_samples": 5}}})
    )

    source = only_source(find_recorded_counts(paths))

    assert source.counts == {}


def test_info_json_of_another_tool_is_ignored(tmp_path):
    paths = write_shards(tmp_path, "x-%04d.tar", [2])
    (tmp_path / "info.json").write_text(json.dumps({"author": "someone", "license": "cc-by"}))

    assert find_recorded_counts(paths) == []


@pytest.mark.parametrize(
    ("split", "complaint"),
    [
        ({"filenames": ["a.tar", "b.tar"], "shard_lengths": [1]}, "has 2 filenames but 1 shard_lengths"),
        ({"filenames": ["a.tar"], "shard_lengths": [-1]}, "shard_lengths[0] is -1"),
        ({"filenames": ["a.tar"], "shard_lengths": ["1"]}, "shard_lengths[0] is '1'"),
        ({"filenames": "a.tar", "shard_lengths": [1]}, "filenames is not a list of file names"),
        ({"filenames": ["a.tar"], "shard_lengths": [4], "num_samples": 5}, "num_samples is 5 but"),
        ("train", "splits.train is a string"),
    ],
)
def test_malformed_timm_info_names_the_file(tmp_path, split, complaint):
    paths = write_shards(tmp_path, "a%s.tar", [1])
    (tmp_path / "_info.json").write_text(json.dumps({"splits": {"train": split}}))

    with pytest.raises(ConfigError) as error:
        find_recorded_counts(paths)

    message = str(error.value)
    assert message.startswith(str(tmp_path / "_info.json")) and complaint in message


# --- img2dataset --------------------------------------------------------------


def test_img2dataset_stats_count_successes_and_skip_shards_without_stats(tmp_path):
    folder = tmp_path / "cc3m"
    first = write_img2dataset_shard(folder, 0, [True, False, True, True, False])
    second = write_img2dataset_shard(folder, 1, [True, True, True], stats=False)  # interrupted
    third = write_img2dataset_shard(folder, 2, [False, True])

    source = only_source(find_recorded_counts([first, second, third]))

    # Failed downloads are not in the tar: the counts match what a reader sees.
    assert source.counts == {first: 3, third: 1}
    assert source.counts == {p: count_samples(p) for p in (first, third)}
    assert source.description == f"img2dataset *_stats.json (2 shards) in {folder}"


@pytest.mark.parametrize(
    ("stats", "complaint"),
    [
        ({"count": 5, "failed_to_download": 5}, "no 'successes' count"),
        ({"count": 5, "successes": -1}, "successes is -1, a negative sample count"),
        ({"count": 5, "successes": 7}, "successes (7) exceed count (5)"),
        ({"count": 5, "successes": "3"}, "successes is '3'"),
    ],
)
def test_malformed_img2dataset_stats_name_the_file(tmp_path, stats, complaint):
    path = write_img2dataset_shard(tmp_path, 0, [True], stats=False)
    (tmp_path / "00000_stats.json").write_text(json.dumps(stats))

    with pytest.raises(ConfigError) as error:
        find_recorded_counts([path])

    message = str(error.value)
    assert message.startswith(str(tmp_path / "00000_stats.json")) and complaint in message


# --- several tools, folders and storage calls ----------------------------------


def test_sources_come_in_order_of_preference(tmp_path):
    # The img2dataset output folder after someone also added an open_clip sizes.json.
    path = write_img2dataset_shard(tmp_path, 0, [True, True, False])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 2}))
    (tmp_path / "_info.json").write_text(
        json.dumps({"splits": {"train": timm_split("train", ["00000.tar"], [2])}})
    )

    sources = find_recorded_counts([path])

    assert [s.description.split(" ")[0] for s in sources] == ["sizes.json", "_info.json", "img2dataset"]
    assert all(s.counts == {path: 2} for s in sources)


def test_one_listing_per_folder_and_reads_only_for_given_shards(tmp_path, monkeypatch):
    folder_a, folder_b = tmp_path / "a", tmp_path / "b"
    shards_a = [write_img2dataset_shard(folder_a, i, [True] * (i + 1)) for i in range(4)]
    shard_b = write_img2dataset_shard(folder_b, 0, [True, False])
    (folder_b / "sizes.json").write_text(json.dumps({"00000.tar": 1}))
    calls: list[tuple[str, str]] = []
    for name in ("list_names", "read_bytes", "exists", "open_read"):
        original = getattr(storage, name)
        monkeypatch.setattr(
            storage,
            name,
            lambda url, _name=name, _original=original: calls.append((_name, url)) or _original(url),
        )

    sources = find_recorded_counts([shards_a[0], shards_a[2], shard_b])

    assert sorted(calls) == sorted(
        [
            ("list_names", str(folder_a)),
            ("list_names", str(folder_b)),
            ("read_bytes", str(folder_a / "00000_stats.json")),
            ("read_bytes", str(folder_a / "00002_stats.json")),
            ("read_bytes", str(folder_b / "sizes.json")),
            ("read_bytes", str(folder_b / "00000_stats.json")),
        ]
    )
    assert [s.counts for s in sources] == [
        {shard_b: 1},
        {shards_a[0]: 1, shards_a[2]: 3},
        {shard_b: 1},
    ]


def test_folder_that_cannot_be_listed_is_skipped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tpustream.data.resolve.recorded"):
        sources = find_recorded_counts(["https://example.invalid/shards/x-0000.tar"])

    assert sources == []
    assert "https://example.invalid/shards" in caplog.text


def test_bare_relative_shard_names_look_in_the_working_directory(tmp_path, monkeypatch):
    write_shards(tmp_path, "%05d.tar", [3])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 3}))
    monkeypatch.chdir(tmp_path)

    assert only_source(find_recorded_counts(["00000.tar"])).counts == {"00000.tar": 3}


def test_counts_on_gcs_through_the_emulator(bucket):
    def put_shard(url: str, samples: int) -> None:
        members = ((f"k{i:04d}.cls", str(i).encode()) for i in range(samples))
        storage.write_bytes(url, write_tar(members))

    for index, samples in enumerate([3, 5]):
        put_shard(f"{bucket}/clip/{index:05d}.tar", samples)
    storage.write_bytes(f"{bucket}/clip/sizes.json", json.dumps({"00000.tar": 3, "00001.tar": 5}).encode())
    storage.write_bytes(f"{bucket}/clip/__len__", b"8")
    put_shard(f"{bucket}/i2d/00000.tar", 2)
    put_shard(f"{bucket}/i2d/00001.tar", 4)
    storage.write_bytes(f"{bucket}/i2d/00000_stats.json", json.dumps(img2dataset_stats(3, 2)).encode())
    put_shard(f"{bucket}/timm/ds-train-0000.tar", 6)
    info = {"splits": {"train": timm_split("train", ["ds-train-0000.tar"], [6])}}
    storage.write_bytes(f"{bucket}/timm/_info.json", json.dumps(info).encode())
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [
            {"url": "../clip/00001.tar", "nsamples": 5},
            {"url": "/timm/ds-train-0000.tar", "nsamples": 6},  # absolute path: same bucket
            {"url": "00000.tar", "nsamples": 2},
        ],
    }
    storage.write_bytes(f"{bucket}/indexes/i2d.json", json.dumps(index).encode())

    urls = [
        f"{bucket}/clip/00000.tar",
        f"{bucket}/clip/00001.tar",
        f"{bucket}/i2d/00000.tar",
        f"{bucket}/i2d/00001.tar",
        f"{bucket}/timm/ds-train-0000.tar",
    ]
    sources = find_recorded_counts(urls)

    assert [s.counts for s in sources] == [
        {urls[0]: 3, urls[1]: 5},
        {urls[4]: 6},
        {urls[2]: 2},  # 00001 has no stats: left to the caller
    ]
    assert all(count_samples(url) == count for s in sources for url, count in s.counts.items())
    assert read_total_hint(f"{bucket}/clip") == 8
    assert read_total_hint(f"{bucket}/timm") is None
    shards, description = read_shard_list(f"{bucket}/indexes/i2d.json")
    assert shards == [(urls[1], 5), (urls[4], 6), (f"{bucket}/indexes/00000.tar", 2)]
    assert description == f"wids index {bucket}/indexes/i2d.json"
