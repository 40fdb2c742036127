"""bench.loaders: its settings, the tpustream and webdataset readers in this process, the table.

Only what the dev extra has: Mosaic streaming, torchdata and Grain (the
loaders extra) are not needed here, and a library that does not import is a
"not installed" row.
"""

from __future__ import annotations

import json

import pytest

from bench.loaders import __main__ as cli
from bench.loaders import report
from bench.loaders.data import DataSpec, prepare_data
from bench.loaders.libraries import READERS, Place, Reader, TpustreamReader, WebLoaderReader
from bench.loaders.measure import Settings, measure_elastic, read_rate, read_resumed

IMAGES, PER_SHARD, BATCH = 64, 16, 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 of the benchmark's JPEGs as files and tar shards (no MDS copy)."""
    root = tmp_path_factory.mktemp("loaders")
    found, record = prepare_data(DataSpec(IMAGES, PER_SHARD), root, with_mds=False)
    assert record["images"] == IMAGES and record["tar_shards"] == IMAGES // PER_SHARD and not record["mds"]
    return found


def test_defaults_hold_the_state_at_half_an_epoch_and_quick_changes_only_what_it_names():
    args = cli.parse_args([])
    assert (args.images, args.batch_size, args.workers, args.elastic_workers) == (3072, 32, [1, 2], 2)
    assert 2 * (args.warmup + args.measured) == args.images // args.batch_size
    assert args.libraries == list(READERS) and args.data == cli.DATA_ROOT / "3072-images"
    quick = cli.parse_args(["--quick", "--workers", "2,1", "--libraries", "webdataset,tpustream"])
    assert (quick.images, quick.workers, quick.libraries) == (256, [2, 1], ["tpustream", "webdataset"])
    assert 2 * (quick.warmup + quick.measured) == quick.images // quick.batch_size


@pytest.mark.parametrize(
    "argv", [["--workers", "0"], ["--libraries", "tensorflow"], ["--measured", "200"], ["--images", "40"]]
)
def test_settings_that_cannot_measure_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("reader_class", [TpustreamReader, WebLoaderReader])
def test_a_row_reads_crops_states_and_resumes(data, reader_class):
    place = Place(0, 1, BATCH, 0)  # no workers: tpustream's would start its fork server (seconds)
    row = read_rate(reader_class, data, place, Settings(BATCH, warmup=2, measured=2, elastic_workers=0))
    assert row["images"] == 2 * BATCH and row["images_per_second"] > 0 and row["state_step"] == 4
    if reader_class is TpustreamReader:
        assert (row["state_format"], row["state"]["step"]) == ("json", 4)
        assert row["state_bytes"] == len(json.dumps(row["state"]).encode())
    else:  # no state of its own: the step a loop keeps, and its resume reads the batches again
        assert (row["state_bytes"], row["state"]) == (None, {"step": 4})
    assert read_resumed(reader_class, data, place, row["state"]) > 0


def test_tpustream_resumes_on_another_world_size_with_nothing_lost_or_repeated(data):
    found = measure_elastic(TpustreamReader, data, Settings(BATCH, 2, 2, elastic_workers=0))
    assert (found["checkpoint_step"], found["global_batch"]) == (2, 2 * BATCH)  # half of 4 steps of 16
    assert found["epoch_distinct"] == IMAGES
    assert (found["duplicated"], found["missed"]) == (0, 0)
    assert found["read_before_checkpoint"] + found["read_after_resume"] == IMAGES


def test_webdataset_skipping_batches_on_another_world_size_repeats_as_many_as_it_misses(data):
    found = measure_elastic(WebLoaderReader, data, Settings(BATCH, 2, 2, elastic_workers=0))
    assert found["epoch_distinct"] == IMAGES
    assert found["read_before_checkpoint"] + found["read_after_resume"] == IMAGES
    assert found["duplicated"] == found["missed"]


def test_a_library_that_does_not_import_is_a_row_saying_so(data, monkeypatch):
    class Absent(Reader):
        name = "absent"
        modules = ("no_such_loader_library",)

    monkeypatch.setitem(READERS, "absent", Absent)
    found = cli.measure_library("absent", data, [1], Settings(BATCH, 2, 2, 1))
    assert "no_such_loader_library" in found["missing"] and found["rows"] == []
    row = {
        "workers": 1,
        "images_per_second": 100.0,
        "images_per_second_per_worker": 100.0,
        "first_batch_seconds": 1.0,
        "resume_seconds": 0.5,
        "resume_how": "load state",
        "state_bytes": 300,
        "state_format": "json",
    }
    results = {
        "settings": {"batch_size": BATCH, "warmup": 2, "measured": 2, "elastic_workers": 1},
        "data": {"images": IMAGES, "avg_bytes": 1e5, "avg_width": 400, "avg_height": 350},
        "environment": {"cpu": "CPU", "cpu_count": 2, "sched_getaffinity": 2, "python": "3", "versions": {}},
        "libraries": [
            {"name": "tpustream", "rows": [row], "elastic": {"duplicated": 0, "missed": 0}},
            {"name": "grain", "rows": [row], "elastic": {"error": "resume on 1 rank: ValueError: a | b"}},
            found,
        ],
    }
    table = report.format_table(results).splitlines()
    assert table[2] == "| tpustream | 1 | 100.0 | 100.0 | 1.00 | 0.50 | 300 B (json) | 0 / 0 |"
    assert table[3].endswith("| fails: resume on 1 rank: ValueError: a / b |")  # no stray column
    assert table[4] == "| absent | - | - | - | - | - | - | not installed |"
