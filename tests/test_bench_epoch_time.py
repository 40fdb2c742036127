"""bench.epoch_time: projection, statistics, formatting, the run plan, and one sweep end to end."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.epoch_time.__main__ import main
from bench.epoch_time.collect import HORIZONS, RunResult, project_total, summarize
from bench.epoch_time.plan import SWITCHES, RunSpec, build_plan, cache_key, check_with_hydra, default_name
from bench.epoch_time.report import CSV_COLUMNS, format_duration, markdown_table, ratios, table_row, write_csv
from tests.conftest import REPO, run_train
from tpustream.training.epoch_report import EpochRecord


def line(epoch: int, train: float, val: float | None = 0.5, **extra) -> EpochRecord:
    """A metrics.jsonl line as train.py writes it (no val_* when validation is off), as the bench reads it.

    Without epoch_seconds and setup_seconds unless given, as train.py wrote lines before they existed.
    """
    record = {
        "epoch": epoch,
        "wall_time": 0.0,
        "train_loss": 1.0,
        "train_samples": 1000,
        "replica_steps": 10,
        "train_seconds": train,
        "global_rate": 100.0,
        "train_filled": 0,
        "lr": 0.1,
        "compilations": 3,
        **extra,
    }
    if val is not None:
        record.update(val_accuracy=0.5, val_correct=5, val_samples=10, val_loss=1.0, val_filled=0)
        record["val_seconds"] = val
    return EpochRecord.from_dict(record)


# ------------------------------------------------------------------ projection


def test_projection_is_setup_plus_epoch1_plus_mean_times_the_other_epochs():
    assert project_total(10.0, 20.0, 3.0, 10) == 57.0
    assert project_total(10.0, 20.0, 3.0, 2000) == 10 + 20 + 3 * 1999
    assert project_total(10.0, 20.0, math.nan, 1) == 30.0  # no later epoch needed
    assert math.isnan(project_total(10.0, 20.0, math.nan, 2))
    with pytest.raises(ValueError):
        project_total(10.0, 20.0, 3.0, 0)


# ------------------------------------------------------------------ statistics


def test_statistics_exclude_epoch_1_and_use_reported_keys():
    records = [
        line(2, 9.0, epoch_seconds=4.0, setup_seconds=7.0, compilations=5),
        line(0, 99.0, epoch_seconds=30.0, setup_seconds=7.0, compilations=4),  # order does not matter
        line(1, 9.0, epoch_seconds=2.0, setup_seconds=7.0, compilations=5),
    ]
    s = summarize(records, process_seconds=100.0, launched_at=0.0)
    assert (s["setup_s"], s["setup_method"]) == (7.0, "reported")
    assert (s["epoch1_s"], s["mean_s"]) == (30.0, 3.0)
    assert s["std_s"] == pytest.approx(math.sqrt(2))  # sample standard deviation of 2 and 4
    assert s["epoch_time_method"] == "epoch_seconds"
    assert s["epoch_seconds"] == [30.0, 2.0, 4.0]
    assert (s["compilations_epoch1"], s["compilations"]) == (4, 5)
    assert s["samples_per_s"] == pytest.approx(2000 / 18)  # training samples / training seconds, epochs 2+
    assert s["total_10_s"] == 7 + 30 + 3 * 9
    assert s["overhead_s"] == pytest.approx(100 - 7 - 36)


def test_epoch_time_falls_back_to_train_plus_validation_seconds():
    s = summarize([line(0, 10.0, 2.0), line(1, 3.0, 1.0), line(2, 5.0, None)])
    assert s["epoch_seconds"] == [12.0, 4.0, 5.0]  # validation off: no val_seconds
    assert s["epoch_time_method"] == "train+val"


def test_setup_falls_back_to_wall_time_then_to_process_time():
    records = [line(0, 10.0, 2.0, wall_time=1000.0 + 5 + 12), line(1, 3.0, 1.0, wall_time=1021.0)]
    by_wall = summarize(records, process_seconds=30.0, launched_at=1000.0)
    assert (by_wall["setup_s"], by_wall["setup_method"]) == (pytest.approx(5.0), "wall_time")
    by_process = summarize([line(0, 10.0, 2.0), line(1, 3.0, 1.0)], process_seconds=30.0)
    assert (by_process["setup_s"], by_process["setup_method"]) == (14.0, "process")
    unknown = summarize([line(0, 10.0, 2.0)])
    assert unknown["setup_method"] == "unknown" and math.isnan(unknown["setup_s"])


def test_one_or_two_epochs_leave_mean_or_std_undefined():
    one = summarize([line(0, 10.0, 2.0, setup_seconds=1.0)])
    assert one["epoch1_s"] == 12.0
    assert math.isnan(one["mean_s"]) and math.isnan(one["std_s"]) and math.isnan(one["samples_per_s"])
    assert math.isnan(one["total_10_s"])
    two = summarize([line(0, 10.0, 2.0, setup_seconds=1.0), line(1, 3.0, 1.0, setup_seconds=1.0)])
    assert two["mean_s"] == 4.0 and math.isnan(two["std_s"])  # one later epoch: no spread to estimate
    with pytest.raises(ValueError):
        summarize([])


# ------------------------------------------------------------------ formatting


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0.0s"),
        (12.34, "12.3s"),
        (59.94, "59.9s"),
        (59.96, "1m 00s"),
        (245.0, "4m 05s"),
        (3599.4, "59m 59s"),
        (3599.6, "1h 00m"),
        (3720.0, "1h 02m"),
        (86399.0, "1d 00h"),
        (51 * 3600.0, "2d 03h"),
        (-3.0, "-3.0s"),
        (math.nan, "n/a"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def summary(setup=10.0, epoch1=20.0, mean=3.0, std=0.5) -> dict:
    s = {"setup_s": setup, "epoch1_s": epoch1, "mean_s": mean, "std_s": std}
    s.update({f"total_{n}_s": project_total(setup, epoch1, mean, n) for n in HORIZONS})
    return s


def result(batch: int, settings: tuple = (), cache: str = "off", error: str = "", **numbers):
    spec = RunSpec(f"bs{batch}", batch, settings, cache, (f"batch_size={batch}",))
    return RunResult(
        spec, ["python", "train.py"], Path("/r"), returncode=0, error=error, summary=summary(**numbers)
    )


def test_table_row_in_the_seeds_layout():
    assert table_row("batch 64, baseline", summary()) == (
        "| batch 64, baseline | 10.0s | 20.0s | 3.0s ± 0.5s | 57.0s | 1m 27s | 2m 57s | 5m 27s "
        "| 10m 27s | 25m 27s | 50m 27s | 1h 40m |"
    )
    assert "| 3.0s | 57.0s |" in table_row("x", summary(std=math.nan))


def test_markdown_table_has_a_row_per_run_and_reports_failures():
    table = markdown_table(
        [result(64, (("validation", "on"),)), result(64, (("validation", "off"),), error="exit code 2")]
    ).splitlines()
    assert table[0] == (
        "| configuration | set-up | epoch 1 | mean epoch (2+) | 10 epochs | 20 epochs | 50 epochs "
        "| 100 epochs | 200 epochs | 500 epochs | 1000 epochs | 2000 epochs |"
    )
    assert table[1] == "| --- | " + " | ".join(["---:"] * 11) + " |"
    assert table[2].startswith("| batch 64, baseline | 10.0s |")
    assert table[3].startswith("| batch 64, validation off | failed (exit code 2) |")
    assert all(row.count("|") == 13 for row in table)


def test_csv_rows_hold_every_column_with_empty_cells_for_nan(tmp_path):
    done = result(128, (("workers", "1"),), std=math.nan)
    done.summary.update(compilations=3, epoch_seconds=[20.0, 3.0], setup_method="reported")
    failed = result(128, error="exit code 1")
    write_csv([done, failed], tmp_path / "runs.csv")
    with open(tmp_path / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_COLUMNS
    assert rows[0]["workers"] == "1" and rows[0]["validation"] == "config"  # not varied: the config decides
    assert (rows[0]["setup_s"], rows[0]["mean_s"], rows[0]["std_s"]) == ("10.000", "3.000", "")
    assert rows[0]["total_10_s"] == "57.000" and rows[0]["compilations"] == "3"
    assert rows[0]["epoch_seconds"] == "20.000;3.000" and rows[0]["status"] == "ok"
    assert rows[1]["status"] == "failed: exit code 1"


def test_ratios_compare_each_single_flip_with_its_batch_sizes_baseline():
    base = (("validation", "on"), ("workers", "4"))
    runs = [
        result(64, base, mean=4.0),
        result(64, (("validation", "off"), ("workers", "4")), mean=3.0),
        result(128, base, mean=2.0),
        result(128, (("validation", "on"), ("workers", "1")), mean=3.0),
        result(128, (("validation", "off"), ("workers", "1")), mean=9.0),  # two flips: no ratio
        result(128, base, cache="cold", mean=9.0),  # not part of the sweep
    ]
    assert ratios(runs) == {"validation off": {64: 0.75}, "workers 1": {128: 1.5}}


# ------------------------------------------------------------------------ plan


def test_default_plan_is_the_baseline_and_one_flip_per_switch():
    plan = build_plan([32, 64], list(SWITCHES), epochs=3, extra=["model=small_cnn"])
    assert [r.name for r in plan[:5]] == [
        "bs32-baseline",
        "bs32-validation-off",
        "bs32-augmentation-off",
        "bs32-source-memory",
        "bs32-workers-1",
    ]
    assert len(plan) == 10
    assert plan[0].overrides == (
        "model=small_cnn",
        "epochs=3",
        "batch_size=32",
        "eval_every=1",
        "data.crop_padding=4",
        "data.hflip=true",
        "data.in_memory=false",
        "data.num_workers=4",
        "xla_cache_dir=null",
    )
    assert plan[3].label == "source memory" and "data.in_memory=true" in plan[3].overrides


def test_full_plan_is_the_cross_product_and_cold_warm_share_a_fresh_cache(tmp_path):
    full = build_plan([64], ["validation", "workers"], epochs=2, full=True)
    assert [r.label for r in full] == ["baseline", "workers 1", "validation off", "validation off, workers 1"]
    cached = build_plan([64], ["workers"], epochs=2, cold_warm=[256], cache_root=tmp_path)
    assert [(r.name, r.cache) for r in cached[-2:]] == [
        ("bs256-baseline-cache-cold", "cold"),
        ("bs256-baseline-cache-warm", "warm"),
    ]
    assert cached[-1].overrides[-1] == cached[-2].overrides[-1] == f"xla_cache_dir={tmp_path / 'bs256'}"
    assert build_plan([8, 16], [], epochs=2)[1].label == "baseline"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("batch_size=8", "sets batch_size itself"),
        ("xla_cache_dir=/c", "sets xla_cache_dir itself"),
        ("data.num_workers=2", "belongs to the switch 'workers'"),
        ("-m", "runs the sweep itself"),
        ("model", "not a Hydra override"),
    ],
)
def test_overrides_that_the_harness_or_a_switch_sets_are_refused(override, message):
    with pytest.raises(SystemExit, match=message):
        build_plan([8], ["workers"], epochs=2, extra=[override])


# ------------------------------------------------------------------ end to end


def run_harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.epoch_time", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )


@pytest.mark.slow
def test_sweep_end_to_end_on_native_pytorch(digits_root, tmp_path):
    # The harness on the native runtime (--accelerator cpu_eager, the GPU path: the same
    # table on both); the XLA CPU device's report is the multirun test's below.
    out = tmp_path / "sweep"
    # A third of the digits and one process keep the 2 runs quick (the plan over several
    # batch sizes and switches: the tests of build_plan above).
    done = run_harness(
        *("--batch-sizes", "128", "--epochs", "2", "--switches", "augmentation", "--out", str(out)),
        *("--accelerator", "cpu_eager"),
        "--",
        f"data.root={digits_root}",
        f"data.train_shards='{digits_root}/train/train-{{000000..000001}}.tar'",
        f"data.val_shards='{digits_root}/test/test-000001.tar'",
        "data.num_workers=0",
        "accelerator.in_process=true",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_COLUMNS
    assert [(r["batch_size"], r["augmentation"], r["status"]) for r in rows] == [
        ("128", "on", "ok"),
        ("128", "off", "ok"),
    ]
    for row in rows:
        assert int(row["compilations"]) == 0, row  # eager: nothing compiles
        assert len(row["epoch_seconds"].split(";")) == 2 and row["epochs"] == "2"
        assert float(row["setup_s"]) > 0 and float(row["mean_s"]) > 0 and row["std_s"] == ""
        assert float(row["total_2000_s"]) > float(row["total_10_s"])
        folder = (
            out
            / "runs"
            / f"bs{row['batch_size']}-{'baseline' if row['augmentation'] == 'on' else 'augmentation-off'}"
        )
        assert (folder / "stdout.log").exists() and (folder / "stderr.log").exists()
        assert not (folder / "checkpoints").exists()

    text = (out / "table.md").read_text()
    assert "Device: CPU (native PyTorch, no XLA)." in text
    assert json.loads((out / "sweep.json").read_text())["device"] == "CPU (native PyTorch, no XLA)"
    table = text.splitlines()
    rows_md = [line for line in table if line.startswith("| batch ")]
    assert [r.split(" | ")[0] for r in rows_md] == [
        "| batch 128, baseline",
        "| batch 128, augmentation off",
    ]
    assert all(r.count("|") == 13 and "n/a" not in r.split(" | ")[3] for r in rows_md)
    for name in ("epoch_time.png", "ratios.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sweep.json").exists()


@pytest.mark.slow
def test_a_hydra_multirun_of_train_py_is_collected_into_the_same_report(digits_root, tmp_path):
    sweep = tmp_path / "multirun"
    multirun = run_train(
        "-m",
        "eval_every=1,0",
        "batch_size=128",
        "epochs=2",
        f"data.root={digits_root}",
        f"data.train_shards='{digits_root}/train/train-{{000000..000001}}.tar'",
        "data.num_workers=0",
        "accelerator.in_process=true",
        f"hydra.sweep.dir={sweep}",
    )
    assert multirun.returncode == 0, multirun.stderr[-3000:]
    out = tmp_path / "report"
    assert main(["--collect", str(sweep), "--out", str(out)]) == 0

    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["batch_size"], r["validation"], r["status"]) for r in rows] == [
        ("0", "128", "on", "ok"),
        ("1", "128", "off", "ok"),
    ]
    for row in rows:
        assert row["setup_method"] == "reported" and float(row["setup_s"]) > 0
        assert len(row["epoch_seconds"].split(";")) == 2 and int(row["compilations"]) > 0
    # The second job ran in the first one's process: its set-up starts at its own start.
    assert float(rows[1]["setup_s"]) < float(rows[0]["setup_s"])
    table = (out / "table.md").read_text()
    assert "| batch 128, baseline |" in table and "| batch 128, validation off |" in table
    assert "(collected)" in table


def test_collect_names_a_folder_without_runs(tmp_path):
    with pytest.raises(SystemExit, match="no train.py runs"):
        main(["--collect", str(tmp_path)])


@pytest.mark.slow
def test_a_failed_run_is_reported_with_its_command_and_stderr(tmp_path):
    out = tmp_path / "sweep"
    done = run_harness(
        *("--batch-sizes", "64", "--epochs", "1", "--switches", "--out", str(out)),
        "--",
        f"data.root={tmp_path}/no-such-shards",
    )
    assert done.returncode == 1
    assert "1 of 1 runs failed" in done.stderr
    assert f"command: {sys.executable} {REPO / 'train.py'} data.root={tmp_path}/no-such-shards" in done.stderr
    assert "no-such-shards/train: cannot list the shards" in done.stderr  # train.py's own error line
    with open(out / "runs.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert row["status"].startswith("failed: exit code") and row["setup_s"] == ""
    assert "## Failed runs" in (out / "table.md").read_text()


def test_every_run_is_composed_with_hydra_before_anything_runs():
    cache = cache_key()
    plan = build_plan([8], ["workers", "augmentation"], epochs=1, cache=cache)
    assert default_name(check_with_hydra(plan)) == "small_cnn-digits-cpu"
    native = build_plan([8], ["workers"], epochs=1, extra=["accelerator=cpu_eager"], cache=cache)
    assert default_name(check_with_hydra(native)) == "small_cnn-digits-cpu_eager"
    typo = build_plan([8], ["workers"], epochs=1, extra=["optim.lrr=0.1"], cache=cache)
    with pytest.raises(SystemExit, match="train.py would refuse run bs8-baseline .*optim.lrr"):
        check_with_hydra(typo)
