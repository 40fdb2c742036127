"""bench.feed: its settings, rows, steady rates, ratios and table, without training anything."""

from __future__ import annotations

import gzip
import json
import sys
import tarfile
from pathlib import Path

import pytest

from bench.feed import __main__ as cli
from bench.feed import data, report, rows
from bench.feed.rows import Row


def test_defaults_are_the_headline_and_quick_changes_only_what_it_names():
    args = cli.parse_args([])
    assert (args.model, args.image_size, args.batch_size, args.epochs) == ("resnet50", 224, 256, 3)
    assert (args.num_images, args.samples_per_shard, args.workers, args.stock_workers) == (
        13000,
        500,
        [8, 15],
        [15],
    )
    assert args.accelerator == "cuda" and args.data == cli.DATA_ROOT / "13000-images"
    quick = cli.parse_args(["--quick", "--accelerator", "cpu_eager", "--epochs", "3", "--workers", "2,1"])
    assert (quick.model, quick.image_size, quick.batch_size, quick.num_images) == ("small_cnn", 64, 32, 320)
    assert (quick.epochs, quick.workers, quick.stock_workers) == (3, [2, 1], [1])  # the command line wins
    assert quick.data == cli.DATA_ROOT / "quick"
    assert cli.parse_args(["--workers", ""]).workers == []  # no tpustream rows


@pytest.mark.parametrize(
    "argv",
    [
        ["--epochs", "1"],
        ["--workers", "8,x"],
        ["--stock-workers", "0"],
        ["--trace-steps", "5,5"],
        ["--trace-steps", "40,51"],  # 13,000 images of 256: epoch 0 ends at step 50
    ],
)
def test_settings_that_cannot_give_a_rate_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_rows_run_synthetic_then_tpustream_then_stock_with_the_same_step(tmp_path):
    args = cli.parse_args([])
    planned = rows.plan_rows(args, tmp_path / "data", tmp_path / "runs", 1000)
    names = ["synthetic", "tpustream w=8", "tpustream w=15", "tpustream device w=4", "stock w=15"]
    assert [r.name for r in planned] == names
    synthetic, w8, _, device, stock = (r.command for r in planned)
    assert (
        "data.decode=device" in device and "data.num_workers=4" in device and "data.decode=device" not in w8
    )
    assert f"output_dir={tmp_path / 'runs' / 'tpustream-device-w4'}" in device
    common = rows.train_overrides(args, tmp_path / "data")
    assert all(o in synthetic and o in w8 for o in common) and "eval_every=0" in common
    assert "data.synthetic=true" in synthetic and "data.num_workers=8" in w8 and "epochs=3" in w8
    assert f"output_dir={tmp_path / 'runs' / 'tpustream-w8'}" in w8
    for option in (
        "--workers=15",
        "--model=resnet50",
        "--image-size=224",
        "--batch-size=256",
        "--precision=bf16",
    ):
        assert option in stock
    assert f"--shards={tmp_path / 'data' / 'train'}" in stock and stock[1:3] == ["-m", "bench.feed.stock"]


def test_trace_steps_trace_every_train_py_row_inside_epoch_0(tmp_path):
    planned = rows.plan_rows(cli.parse_args(["--trace-steps", "40,50"]), tmp_path, tmp_path / "runs", 1000)
    assert [("debug.profile_steps=[40,50]" in r.command) for r in planned] == [True] * 4 + [False]
    untraced = rows.plan_rows(cli.parse_args([]), tmp_path, tmp_path / "runs", 1000)
    assert not any("debug.profile_steps" in part for r in untraced for part in r.command)


def test_dry_run_prints_every_command_and_makes_nothing(tmp_path, capsys):
    assert cli.main(["--dry-run", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


def test_the_rate_leaves_out_epoch_0_and_needs_a_later_epoch():
    records = [
        {"global_rate": 100.0, "input_wait_fraction": 0.9},
        {"global_rate": 900.0, "input_wait_fraction": 0.1, "input_bound_fraction": 0.05},
        {"global_rate": 1100.0, "input_wait_fraction": 0.3},
    ]
    summary = rows.summarise_run(records)
    assert summary["images_per_second"] == 1000.0 and summary["epoch_rates"] == [100.0, 900.0, 1100.0]
    assert summary["input_wait_fraction"] == pytest.approx(0.2)
    assert summary["input_bound_fraction"] == 0.05  # the mean over the epochs that have it
    assert rows.summarise_run(records[:1])["images_per_second"] is None  # epoch 0 alone is no steady rate
    assert rows.summarise_run([])["images_per_second"] is None


def measured_rows(rates: dict[str, float | None]) -> list[Row]:
    found = []
    for name, rate in rates.items():
        kind, _, workers = name.partition(" w=")
        row = Row(name, kind, int(workers) if workers else None, Path(name), [])
        row.result = {"images_per_second": rate, "input_wait_fraction": 0.25 if rate else None}
        row.result["input_making_share"] = 0.5 if rate and kind == "tpustream" else None
        if rate is None:
            row.result["error"] = "timed out"
        found.append(row)
    return found


def test_ratios_are_against_synthetic_and_the_fastest_stock_row():
    table = measured_rows(
        {
            "synthetic": 4000.0,
            "tpustream w=8": 3900.0,
            "tpustream w=15": None,
            "stock w=8": 1500.0,
            "stock w=15": 2000.0,
        }
    )
    report.add_ratios(table)
    results = {r.name: r.result for r in table}
    assert results["tpustream w=8"]["of_synthetic"] == 0.975 and results["tpustream w=8"]["of_stock"] == 1.95
    assert results["stock w=8"]["of_stock"] == 0.75 and results["tpustream w=15"]["of_synthetic"] is None
    found = report.goals(table)
    assert found["row"] == "tpustream w=8" and found["of_synthetic_met"] and found["of_stock_met"]
    text = report.format_table(table)
    assert "| tpustream | 8 | 3,900.0 | 0.97 | 1.95x | - | 25.0% | 50.0% |  |" in text
    assert "| tpustream | 15 | - | - | - | - | - | - | timed out |" in text
    assert "(>= 0.95: met), 1.95x stock (>= 1.7x: met)" in report.describe_goals(found)


def test_without_a_stock_or_synthetic_rate_the_goals_say_not_measured():
    table = measured_rows({"synthetic": None, "tpustream w=8": 1000.0})
    report.add_ratios(table)
    found = report.goals(table)
    assert found["of_synthetic_met"] is None and found["of_stock_met"] is None
    assert "not measured" in report.describe_goals(found)
    assert report.goals(measured_rows({"synthetic": 10.0})) is None


def test_shards_cover_each_split_once_and_hold_jpegs_with_labels(tmp_path):
    spec = data.DataSpec(train_images=1100, val_images=30, samples_per_shard=500, num_classes=7)
    planned = data.plan_shards(spec, tmp_path)
    assert [t.count for t in planned["train"]] == [500, 500, 100] and [t.first for t in planned["val"]] == [
        1100
    ]
    assert Path(planned["train"][1].path).name == "train-000001.tar"
    (tmp_path / "val").mkdir()
    task = data.ShardTask(str(tmp_path / "val" / "val-000000.tar"), 1100, 2, 7, 0)
    samples, sizes, _ = data.write_shard(task)
    with tarfile.open(task.path) as tar:
        names = tar.getnames()
        label = tar.extractfile("00001101.cls").read()
    assert samples == 2 and names == ["00001100.jpg", "00001100.cls", "00001101.jpg", "00001101.cls"]
    assert label == b"2" and all(300 < max(size) < 730 for size in sizes)  # 1101 % 7, about 480 px long


@pytest.mark.parametrize(("listing", "count"), [("0-1\n", 2), ("0,8", 2), ("3", 1), ("0-1,4-5", 4)])
def test_threads_per_core_reads_the_kernels_cpu_lists(listing, count):
    assert report.cpu_list_size(listing) == count


def test_a_traced_rows_result_says_where_its_gpu_time_went(tmp_path):
    from tests.test_trace_gaps import two_steps

    folder = tmp_path / "tpustream-w8"
    traces = folder / "tensorboard" / "profile-steps-30-32"
    traces.mkdir(parents=True)
    with gzip.open(traces / "host_1.2.pt.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": two_steps()}, handle)
    row = Row("tpustream w=8", "tpustream", 8, folder, [sys.executable, "-c", "pass"])
    row.result = rows.run_row(row, timeout=60)
    (gaps,) = row.result["trace_gaps"].values()
    assert gaps["steps"] == 2 and gaps["idle_by_cause_ms"]["input"] == pytest.approx(0.3)
    assert "compute stream idle 0.7 ms (49.3%) in 4 gaps" in rows.describe_result(row).splitlines()[1]
