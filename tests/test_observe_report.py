"""tpustream-report: a run's table, advice and curves; several runs or a Hydra multirun compared."""

from __future__ import annotations

import pytest

from tests.fake_runtime import tiny_config
from tpustream import storage
from tpustream.checkpoint import write_config
from tpustream.observe.report import main, report


@pytest.fixture
def two_runs(fake_job, tmp_path):
    runs = []
    for name, batch in (("small", 4), ("large", 8)):
        run = str(tmp_path / name)
        cfg = tiny_config(run, epochs=2, batch_size=batch)
        fake_job(cfg)
        runs.append(run)
    return runs


def test_one_run_is_a_table_per_epoch_with_its_advice_and_a_png_beside_it(two_runs, capsys):
    run = two_runs[0]
    assert main([run]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].split()[:5] == ["epoch", "acc", "top5", "loss", "samples/s"]
    assert [line.split()[0] for line in text.splitlines()[2:4]] == ["0", "1"]
    assert storage.read_bytes(f"{run}/report.png").startswith(b"\x89PNG")


def test_runs_are_compared_by_the_config_values_that_differ(two_runs, tmp_path):
    text = report(two_runs, str(tmp_path / "all.png"))
    header, small, large = text.splitlines()[:3]
    assert header.split()[:3] == ["run", "best", "acc"]
    assert small.startswith("small") and small.endswith("batch_size=4")
    assert large.startswith("large") and large.endswith("batch_size=8")
    assert (tmp_path / "all.png").read_bytes().startswith(b"\x89PNG")


def test_a_hydra_multirun_folder_and_a_bucket_run_are_found(two_runs, tmp_path, bucket):
    sweep = tmp_path / "multirun"
    for number, run in enumerate(two_runs):
        (sweep / str(number) / ".hydra").mkdir(parents=True)
        (sweep / str(number) / ".hydra" / "config.yaml").write_text(f"output_dir: {run}\n")
    assert report([str(sweep)], None, draw=False).splitlines()[1].startswith("small")
    # A run folder in a bucket (running, finished or preempted alike: metrics.jsonl is enough).
    remote = f"{bucket}/runs/small"
    storage.write_bytes(f"{remote}/metrics.jsonl", storage.read_bytes(f"{two_runs[0]}/metrics.jsonl"))
    write_config(remote, {"batch_size": 4})
    text = report([remote], None)
    assert text.startswith(remote) and storage.exists(f"{remote}/report.png")


def test_a_folder_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("no metrics.jsonl in it nor in the output_dir of any job folder")
    )
