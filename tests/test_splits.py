"""Shard specifications without our manifest: counts from other tools' files, our index, or counting."""

from __future__ import annotations

import json
import logging
import os
import tarfile
from pathlib import Path

import pytest

from tests.conftest import numbered_samples, png_bytes, solid_image, write_tar, write_wds_shards
from tpustream import storage
from tpustream.data.resolve import counting as shard_index
from tpustream.data.resolve.counting import INDEX_NAME
from tpustream.data.resolve.index_command import main as index_main
from tpustream.data.resolve.split import SplitOptions, load_split
from tpustream.errors import ConfigError, StorageError

DIGITS = SplitOptions(num_classes=10, progress=False)


@pytest.fixture
def wds_split(tmp_path) -> str:
    """25 samples written by webdataset's ShardWriter as the reference CIFAR notebook does (ppm + cls)."""
    folder = str(tmp_path / "wds")
    write_wds_shards(folder, "cifar-train-%06d.tar", 25, maxcount=7, image_field="ppm")
    return folder


def test_folder_without_manifest_is_counted_once_and_indexed_beside_the_shards(wds_split, monkeypatch):
    split = load_split(wds_split, "train", DIGITS)
    assert [s.samples for s in split.shards] == [7, 7, 7, 4]
    assert split.shards[0].url == f"{wds_split}/cifar-train-000000.tar"
    assert split.image_size == (8, 8) and split.channels == 3 and split.image_format == "ppm"
    assert split.classes == [str(c) for c in range(10)]
    assert "counted now" in split.counts_from
    doc = json.loads(Path(wds_split, INDEX_NAME).read_text())
    assert doc["num_samples"] == 25 and [s["name"] for s in doc["shards"]][0] == "cifar-train-000000.tar"

    def no_counting(*args, **kwargs):
        raise AssertionError("counted again")

    monkeypatch.setattr(shard_index, "count_shards", no_counting)
    again = load_split(wds_split, "train", DIGITS)
    assert again.shards == split.shards and again.counts_from.startswith("index ")


def test_a_rewritten_shard_is_counted_again_saying_so(wds_split, caplog):
    load_split(wds_split, "train", DIGITS)
    write_wds_shards(
        wds_split, "cifar-train-%06d.tar", 3, maxcount=3, image_field="ppm"
    )  # shard 0: 3 samples
    with caplog.at_level(logging.WARNING, logger="tpustream.data.resolve.counting"):
        split = load_split(wds_split, "train", DIGITS)
    assert "1 shard(s) changed since they were indexed" in caplog.text
    assert [s.samples for s in split.shards] == [3, 7, 7, 4]


def test_read_only_shards_are_indexed_in_the_output_dir(wds_split, tmp_path, monkeypatch):
    write_bytes = storage.write_bytes

    def read_only_shards(url: str, data: bytes) -> None:
        if url.startswith(wds_split):  # as a bucket the job may only read
            raise StorageError(f"{url}: permission denied (403)")
        write_bytes(url, data)

    monkeypatch.setattr(storage, "write_bytes", read_only_shards)
    run = str(tmp_path / "run")
    split = load_split(wds_split, "train", SplitOptions(num_classes=10, output_dir=run, progress=False))
    assert split.num_samples == 25
    assert not os.path.exists(os.path.join(wds_split, INDEX_NAME))
    assert len(os.listdir(tmp_path / "run" / "shard-index")) == 1
    again = load_split(wds_split, "train", SplitOptions(num_classes=10, output_dir=run, allow_counting=False))
    assert again.shards == split.shards and "shard-index" in again.counts_from


def test_index_never_makes_a_missing_count_an_error_naming_the_command(wds_split):
    with pytest.raises(ConfigError, match=r"no sample count for 4 shard\(s\).*tpustream-index"):
        load_split(wds_split, "train", SplitOptions(num_classes=10, allow_counting=False))
    assert index_main([wds_split, "--no-progress"]) == 0
    split = load_split(wds_split, "train", SplitOptions(num_classes=10, allow_counting=False))
    assert split.num_samples == 25


def test_patterns_lists_and_gzipped_shards(wds_split, tmp_path):
    gz = tmp_path / "gz"
    gz.mkdir()
    for index in range(2):
        with (
            tarfile.open(gz / f"part-{index}.tar.gz", "w:gz") as out,
            tarfile.open(f"{wds_split}/cifar-train-00000{index}.tar") as source,
        ):
            for member in source.getmembers():
                out.addfile(member, source.extractfile(member))
    spec = [f"{wds_split}/cifar-train-{{000002..000003}}.tar", str(gz / "part-{0..1}.tar.gz")]
    split = load_split(spec, "train", DIGITS)
    assert [s.samples for s in split.shards] == [7, 4, 7, 7]
    assert split.shards[2].url == str(gz / "part-0.tar.gz")
    with pytest.raises(ConfigError, match="named twice"):
        load_split([wds_split, f"{wds_split}/cifar-train-000000.tar"], "train", DIGITS)


def test_pipe_urls_are_read_through_webdataset(wds_split):
    url = f"pipe:cat {wds_split}/cifar-train-000003.tar"
    split = load_split(url, "train", SplitOptions(num_classes=10, image_size=8, progress=False))
    assert [s.samples for s in split.shards] == [4]


def test_missing_classes_and_empty_folders_are_one_line_errors(wds_split, tmp_path):
    with pytest.raises(ConfigError, match="no tpustream manifest naming their classes; set data.num_classes"):
        load_split(wds_split, "train", SplitOptions(progress=False))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: no shards \(\*.tar, \*.tar.gz, \*.tgz\) and no manifest"):
        load_split(str(tmp_path / "empty"), "train", DIGITS)


def test_the_index_command_fails_when_it_cannot_save_the_index(wds_split, monkeypatch, capsys):
    """Counted but not saved is a failure (exit 2) that points at --output-dir."""

    def read_only(url: str, data: bytes) -> None:
        raise StorageError(f"{url}: read-only file system")

    monkeypatch.setattr(storage, "write_bytes", read_only)
    assert index_main([wds_split, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "index could not be saved beside the shards; give --output-dir" in err


def test_unreadable_first_samples_get_the_advice_that_can_help(tmp_path):
    """Npy members or dotted names need data.image_key, not data.image_size."""
    folder = tmp_path / "odd"
    folder.mkdir()
    png = png_bytes(solid_image(1))
    members = [("0.npy", b"\x93NUMPY"), ("0.cls", b"1"), ("1.x.png", png), ("1.cls", b"2")]
    (folder / "odd-000000.tar").write_bytes(write_tar(members))
    with pytest.raises(ConfigError, match=r"no image field .* set data.image_key to the field") as caught:
        load_split(str(folder), "train", DIGITS)
    assert "data.image_size" not in str(caught.value)
    named = SplitOptions(num_classes=10, image_key="x.png", progress=False)
    assert load_split(str(folder), "train", named).image_size == (8, 8)


def test_gcs_shards_without_manifest(bucket, tmp_path):
    local = str(tmp_path / "local")
    write_wds_shards(local, "shard-%03d.tar", 10, maxcount=4, image_field="png")
    for name in sorted(os.listdir(local)):
        storage.write_bytes(f"{bucket}/wds/{name}", Path(local, name).read_bytes())
    split = load_split(f"{bucket}/wds", "train", DIGITS)
    assert [s.samples for s in split.shards] == [4, 4, 2] and split.image_format == "png"
    assert storage.exists(f"{bucket}/wds/{INDEX_NAME}")
    assert load_split(f"{bucket}/wds/shard-{{000..002}}.tar", "train", DIGITS).counts_from.startswith("index")


def test_open_clip_len_is_a_check_on_the_counts(wds_split, caplog):
    Path(wds_split, "__len__").write_text("30\n")
    with caplog.at_level(logging.WARNING, logger="tpustream.data.resolve.split"):
        assert load_split(wds_split, "train", DIGITS).num_samples == 25
    assert "open_clip's __len__ says 30 samples, but the shards hold 25" in caplog.text


def test_sizes_json_beside_the_shards_spares_the_counting(wds_split, monkeypatch):
    sizes = {f"cifar-train-00000{i}.tar": n for i, n in enumerate([7, 7, 7, 4])}
    Path(wds_split, "sizes.json").write_text(json.dumps(sizes))
    monkeypatch.setattr(shard_index, "count_shards", lambda *a, **k: pytest.fail("counted"))
    split = load_split(wds_split, "train", DIGITS)
    assert split.num_samples == 25 and "sizes.json" in split.counts_from
    assert not Path(wds_split, INDEX_NAME).exists()


def test_a_wids_index_names_the_shards_and_the_log_says_where_counts_came_from(wds_split, monkeypatch):
    shardlist = [{"url": f"cifar-train-00000{i}.tar", "nsamples": n} for i, n in enumerate([7, 7, 7, 4])]
    index = Path(wds_split, "train.json")
    index.write_text(
        json.dumps({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist})
    )
    monkeypatch.setattr(shard_index, "count_shards", lambda *a, **k: pytest.fail("counted"))
    split = load_split(str(index), "train", DIGITS)
    assert split.num_samples == 25 and split.counts_from == f"wids index {index}"
    monkeypatch.undo()
    pattern_split = load_split(f"{wds_split}/cifar-train-{{000000..000001}}.tar", "train", DIGITS)
    assert pattern_split.num_samples == 14  # a pattern beside it: counted, no manifest there


def test_wrong_label_and_image_keys_fail_at_load_naming_key_sample_and_fields(write_split):
    samples = [
        (key, fields | {"json": json.dumps({"label": int(fields["cls"])}).encode()})
        for key, fields in numbered_samples(0, 4)
    ]
    folder = write_split("train", [samples])
    assert load_split(folder, "train", SplitOptions(label_key="json:label")).num_samples == 4
    with pytest.raises(
        ConfigError,
        match=rf"data.label_key=json:lable reads no label from sample 000000 of {folder}/train-000000.tar: "
        r"missing label \(json has no lable\); its json's fields: label",
    ):
        load_split(folder, "train", SplitOptions(label_key="json:lable"))
    with pytest.raises(
        ConfigError, match=r"data.image_key=jpg reads no image .*among fields: cls, json, png"
    ):
        load_split(folder, "train", SplitOptions(label_key="cls", image_key="jpg"))
    # Labels past data.num_classes: the key works, the class count is what to fix.
    fives = [[(k, f | {"cls": b"5"}) for k, f in numbered_samples(0, 4)]]
    with pytest.raises(ConfigError, match=r"has label 5 outside 0..1 \(the split's 2 classes\): set data"):
        load_split(write_split("fives", fives, num_classes=2), "train", SplitOptions(label_key="cls"))
    del samples[0][1]["json"]  # a first sample without the field is bad data, not a wrong key
    assert (
        load_split(write_split("val", [samples]), "", SplitOptions(label_key="json:label")).num_samples == 4
    )


def with_bad_start(samples: list, bad: int, fields: dict[str, bytes]) -> list:
    """The samples with the first `bad` of them holding only `fields` (and their label)."""
    return [(k, {**fields, "cls": f["cls"]} if i < bad else f) for i, (k, f) in enumerate(samples)]


def test_bad_samples_at_the_start_are_bad_data_not_a_wrong_key(write_split, tmp_path):
    """Three bad samples first are skipped and counted, not taken for "image_key reads no image"."""
    options = SplitOptions(label_key="cls", progress=False)
    undecodable = with_bad_start(numbered_samples(0, 10), 3, {"png": b"not a png"})
    assert load_split(write_split("train", [undecodable]), "train", options).num_samples == 10
    imageless = with_bad_start(numbered_samples(0, 10), 3, {})
    assert load_split(write_split("imageless", [imageless]), "train", options).num_samples == 10
    # A first shard of bad samples only: the next shard has good ones.
    folder = write_split("shards", [undecodable[:3], numbered_samples(3, 4)])
    assert load_split(folder, "train", options).num_samples == 7
    # No manifest: the image size comes from the first sample that has one.
    storage.write_bytes(
        str(tmp_path / "bare" / "bare-000000.tar"),
        write_tar(
            (f"{k}.{e}", d) for k, f in with_bad_start(numbered_samples(0, 9), 6, {}) for e, d in f.items()
        ),
    )
    bare = load_split(
        str(tmp_path / "bare"), "train", SplitOptions(num_classes=10, label_key="cls", progress=False)
    )
    assert bare.image_size == (8, 8)


def test_a_key_is_blamed_only_when_no_first_sample_has_its_field(write_split):
    options = SplitOptions(label_key="cls", progress=False)
    imageless = with_bad_start(numbered_samples(0, 5), 5, {"txt": b"a caption"})
    with pytest.raises(ConfigError, match=r"data.image_key \(unset\) reads no image from sample 000000"):
        load_split(write_split("imageless", [imageless]), "train", options)
    # The field is there in some and decodes in none: the data is at fault, and the error says which sample.
    broken = with_bad_start(imageless, 2, {"png": b"not a png"})
    folder = write_split("broken", [broken])
    with pytest.raises(ConfigError) as refused:
        load_split(folder, "train", options)
    assert str(refused.value).startswith(
        f"{folder}: none of the first 5 samples gives an image and a label as training reads them; "
        f"the first: png in sample 000000 of {folder}/broken-000000.tar: cannot decode png: "
    )


def test_raw_pixels_with_random_resized_crops_fail_at_load(write_split):
    raw = [(f"{i:06d}", {"raw": bytes(3 * 8 * 8), "cls": b"1"}) for i in range(3)]
    folder = write_split("train", [raw], image_format="raw")
    assert load_split(folder, "train", SplitOptions(label_key="cls")).image_format == "raw"
    with pytest.raises(ConfigError, match="data.train_crop=random_resized crops encoded images.*raw pixels"):
        load_split(folder, "train", SplitOptions(label_key="cls", crop=True, image_size=8))
