"""bench.pipeline: what the command line needs from each dataset, the rows' loop, the in-memory limits."""

from __future__ import annotations

import pytest

from bench.pipeline import __main__ as cli
from bench.pipeline import cifar, cifar_data, harness


@pytest.mark.parametrize("name", sorted(cli.DATASETS))
def test_every_dataset_supplies_what_the_command_line_uses(name):
    dataset = cli.DATASETS[name]
    assert dataset.DEFAULT_NUM_IMAGES > dataset.QUICK_NUM_IMAGES >= 4 * harness.BATCH_SIZE
    assert callable(dataset.run) and dataset.RESULTS.startswith("results")
    names = [config.name for config in dataset.CONFIGS]
    assert names[:2] == ["L", "L_ours"] and len(set(names)) == len(names)
    assert all(isinstance(config, harness.Config) for config in dataset.CONFIGS)
    assert [title for title, _ in dataset.RATIOS][0] == "x L"


def test_defaults_follow_the_dataset_and_quick():
    args = cli.parse_args([])
    assert (args.out, args.num_images, args.min_seconds) == (harness.BENCH / "results", 20000, 3.0)
    args = cli.parse_args(["--dataset", "imagenet", "--quick"])
    assert (args.out, args.num_images, args.min_seconds) == (
        harness.BENCH / "results" / "imagenet" / "quick",
        512,
        1.0,
    )


@pytest.mark.parametrize(
    "argv", [["--profile", "ours-raw-local", "--dataset", "imagenet"], ["--num-images", "8"]]
)
def test_bad_options_stop_before_any_data_is_made(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_rows_have_a_label_per_worker_count_and_a_mode_only_when_given(capsys):
    def build(config: harness.Config, workers: int) -> harness.Epoch:
        return lambda: iter([([0], [0])] * (2 + workers))

    configs = [harness.Config("limit", build, ()), harness.Config("loader", build)]
    rows = harness.measure_configs(configs, build, min_seconds=1e-9)
    assert [(r["name"], r["workers"], r["samples"]) for r in rows] == [
        ("limit", None, 1),
        ("loader", 0, 1),
        ("loader", 2, 3),
    ]
    assert "mode" not in rows[0] and "foreign_cores" in rows[0]
    (row,) = harness.measure_configs(configs[:1], build, min_seconds=1e-9, mode="eval")
    assert row["mode"] == "eval"
    assert "limit eval " in capsys.readouterr().out


def test_cifar_limits_decode_the_same_images_in_memory():
    images, labels, _ = cifar_data.make_images(4 * harness.BATCH_SIZE + 5, seed=0)
    png = [cifar_data.encode_image(image, "png") for image in images]
    keys = [f"{i:08d}" for i in range(len(png))]
    data = cifar_data.BenchData(keys, [int(label) for label in labels], png, image_folder="unused")
    # The clock starts after the first batch; L_ours keeps full batches only (last_batch="drop").
    assert harness.timed_pass(cifar.limit_stock(data, 0))[0] == 3 * harness.BATCH_SIZE + 5
    assert harness.timed_pass(cifar.limit_ours(data, 0))[0] == 3 * harness.BATCH_SIZE
    image, label = next(cifar.limit_ours(data, 0)())
    assert image.shape == (harness.BATCH_SIZE, 3, 32, 32) and image.dtype.is_floating_point
    assert label.tolist() == data.labels[: harness.BATCH_SIZE]


def test_receiving_times_the_pieces_it_receives():
    from bench.pipeline import receiving

    row = receiving.measure(2, 40)
    assert row["pieces"] == 40 and row["workers"] == 2
    assert 0 < row["cpu_us_per_piece"] <= row["wall_us_per_piece"] + 1  # one thread: CPU within wall
    assert row["cpu_ms_per_batch"] == pytest.approx(row["cpu_us_per_piece"] * 2 / 1000)
    # Beside a thread that holds the GIL in pure Python, a piece waits for it (up to 5 ms each).
    row = receiving.measure(1, 40, contender="python")
    assert row["wall_us_per_piece"] > 3 * row["cpu_us_per_piece"]


def test_the_scaling_table_says_how_much_of_the_consumers_waits_were_for_the_making():
    from bench.pipeline import scaling

    row = {
        "workers": 2,
        "streams_per_worker": [4, 4],
        "images_per_s": 2000.0,
        "replica_ms_per_batch": 6.0,
        "replica_cores": 0.05,
        "worker_cores": [0.9, 0.9],
        "making_share": 0.9,
    }
    stages = {
        "images": 10,
        "read_ms": 0.05,
        "decode_ms": 0.6,
        "decode_whole_image_ms": 0.7,
        "window_decoding": True,
        "crop_resize_ms": 0.3,
        "batch_ms": 0.02,
        "one_core_images_per_s": 1000.0,
        "device_decode_worker_ms": 0.01,
    }
    lines = scaling.describe([row, {**row, "workers": 4, "making_share": None}], stages).splitlines()
    assert lines[0].endswith("| worker cores (mean) | waits for making |")
    assert lines[2] == "| 2 | 4 | 2,000 | 1,000 | 1.00 | 6.0 | 0.05 | 0.90 | 90% |"
    assert lines[3].endswith("| 0.90 | - |")  # no wait to split
