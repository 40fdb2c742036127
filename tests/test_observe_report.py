"""tpustream-report: a run's table, advice and curves; several runs or a Hydra multirun compared."""

from __future__ import annotations

import pytest

from tpustream import storage
from tpustream.checkpoint import write_config, write_metrics
from tpustream.observe.report import main, report


def epoch(number: int, accuracy: float, rate: float, wait: float) -> dict:
    """A metrics.jsonl line as the trainer writes it (the fields the report reads)."""
    return {
        "epoch": number,
        "train_loss": 2.0 - number,
        "val_accuracy": accuracy,
        "val_top5": 0.9,
        "val_loss": 1.0,
        "global_rate": rate,
        "input_wait_fraction": wait,
        "input_wait_fraction_worst": wait,
        "compilations": 3,
        "checkpoint_stall_seconds": 0.1,
        "epoch_seconds": 10.0,
    }


@pytest.fixture
def two_runs(tmp_path):
    """Two finished runs that differ in data.num_workers: the second waited less for input."""
    runs = []
    for name, workers, wait in (("w0", 0, 0.6), ("w2", 2, 0.05)):
        run = str(tmp_path / name)
        write_metrics(run, [epoch(0, 0.5, 100.0, 0.7), epoch(1, 0.8, 200.0, wait)])
        write_config(run, {"output_dir": run, "data": {"num_workers": workers}, "batch_size": 8})
        runs.append(run)
    return runs


def test_one_run_is_a_table_per_epoch_with_its_advice_and_a_png_beside_it(two_runs, capsys):
    run = two_runs[0]
    assert main([run]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].split()[:5] == ["epoch", "acc", "top5", "loss", "samples/s"]
    assert [line.split()[0] for line in text.splitlines()[2:4]] == ["0", "1"]
    assert "advice: input-bound: the training thread waited for batches 60% of the time" in text
    assert "raise data.num_workers from 0 to about 4" in text
    assert storage.read_bytes(f"{run}/report.png").startswith(b"\x89PNG")


def test_runs_are_compared_by_the_config_values_that_differ(two_runs, tmp_path):
    text = report(two_runs, str(tmp_path / "all.png"))
    header, w0, w2 = text.splitlines()[:3]
    assert header.split()[:3] == ["run", "best", "acc"]
    # Best accuracy, steady rate, input-bound share (none measured) and host wait (epoch 0 left
    # out), and only what differs.
    assert w0.split() == ["w0", "80.0%", "200.0", "-", "60.0%", "2", "data.num_workers=0"]
    assert w2.split() == ["w2", "80.0%", "200.0", "-", "5.0%", "2", "data.num_workers=2"]
    assert (tmp_path / "all.png").read_bytes().startswith(b"\x89PNG")
    assert "advice:" not in text  # the same rate with 0 and 2 workers


def test_the_devices_input_bound_share_stands_beside_the_hosts_wait(tmp_path):
    """A run at 98% of its GPU's own rate waited 29% host-side; the device idled 2% for input."""
    run = str(tmp_path / "gpu")
    records = [epoch(number, 0.8, 3033.0, 0.29) for number in range(3)]
    for record in records:
        record.update(input_bound_fraction=0.02, input_bound_fraction_worst=0.03, device_idle_fraction=0.04)
    write_metrics(run, records)
    write_config(run, {"output_dir": run, "data": {"num_workers": 12}})
    header, *rows = report([run], None, draw=False).splitlines()[1:3]
    assert header.split()[4:8] == ["samples/s", "input-bound", "host", "wait"]
    assert rows[0].split()[4:7] == ["3033.0", "2.0%", "29.0%"]
    rows = report([run, run], None, draw=False).splitlines()
    assert rows[0].split()[3:7] == ["samples/s", "input-bound", "host", "wait"]
    assert rows[1].split()[2:5] == ["3033.0", "2.0%", "29.0%"]


def test_runs_where_more_workers_were_slower_say_so(tmp_path):
    """12 workers ran 5% slower than 4 on a 16-vCPU host: the comparison of the runs says so."""
    runs = []
    for workers, rate in ((4, 3033.0), (12, 2882.0)):
        run = str(tmp_path / f"w{workers}")
        write_metrics(run, [epoch(0, 0.5, 1000.0, 0.7), epoch(1, 0.8, rate, 0.29), epoch(2, 0.8, rate, 0.29)])
        write_config(run, {"output_dir": run, "data": {"num_workers": workers}, "batch_size": 256})
        runs.append(run)
    advice = report(runs, None, draw=False).splitlines()[-1]
    assert advice.startswith(
        "advice: too many workers: data.num_workers=12 ran at 2882 samples/s, slower than "
        "data.num_workers=4 at 3033"
    )


def test_a_hydra_multirun_folder_and_a_bucket_run_are_found(two_runs, tmp_path, bucket):
    sweep = tmp_path / "multirun"
    for number, run in enumerate(two_runs):
        (sweep / str(number) / ".hydra").mkdir(parents=True)
        (sweep / str(number) / ".hydra" / "config.yaml").write_text(f"output_dir: {run}\n")
    assert report([str(sweep)], None, draw=False).splitlines()[1].startswith("w0")
    # A run folder in a bucket (running, finished or preempted alike: metrics.jsonl is enough).
    remote = f"{bucket}/runs/w0"
    storage.write_bytes(f"{remote}/metrics.jsonl", storage.read_bytes(f"{two_runs[0]}/metrics.jsonl"))
    write_config(remote, {"batch_size": 8})
    text = report([remote], None)
    assert text.startswith(remote) and storage.exists(f"{remote}/report.png")


def test_a_folder_without_a_run_or_no_folder_at_all_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("nor in the output_dir of any job folder")
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"tpustream-report: {tmp_path / 'nowhere'} does not exist"


def hydra_job(sweep, number: int, output_dir: str, cwd) -> str:
    """A multirun job folder as Hydra 1.3 writes it: the job's config unresolved, Hydra's own resolved."""
    job = sweep / str(number)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(f"output_dir: {output_dir}\ndata:\n  num_workers: {number}\n")
    (job / ".hydra" / "hydra.yaml").write_text(
        f"hydra:\n  job:\n    num: {number}\n  runtime:\n    cwd: {cwd}\n    output_dir: {job}\n"
    )
    return str(job)


def test_a_hydra_multirun_with_output_dir_left_to_hydra_is_found(tmp_path):
    """output_dir is ${hydra:runtime.output_dir} in each job's .hydra/config.yaml."""
    sweep = tmp_path / "sweep"
    for number in (0, 1):
        job = hydra_job(sweep, number, "${hydra:runtime.output_dir}", tmp_path)
        write_metrics(job, [epoch(0, 0.5, 100.0, 0.7), epoch(1, 0.6 + number / 10, 200.0, 0.1)])
        write_config(job, {"output_dir": job, "data": {"num_workers": number}})
    # And one whose output_dir was set relative to where train.py ran (Hydra's runtime.cwd).
    hydra_job(sweep, 2, "runs/${hydra:job.num}", tmp_path)
    write_metrics(str(tmp_path / "runs" / "2"), [epoch(0, 0.9, 100.0, 0.1)])
    rows = report([str(sweep)], None, draw=False).splitlines()[1:4]
    assert [row.split()[:2] for row in rows] == [["0", "60.0%"], ["1", "70.0%"], ["2", "90.0%"]]


def test_a_run_stopped_in_its_first_epoch_is_a_run_that_has_not_finished_an_epoch(tmp_path, capsys):
    """config.yaml and last.pt but no metrics.jsonl yet: where last.pt is."""
    from tpustream.checkpoint import encode_checkpoint

    run = str(tmp_path / "run")
    write_config(run, {"output_dir": run, "data": {"num_workers": 0}})
    state = {"position": {"epoch": 0, "step": 12}, "data_plan": {"steps_per_epoch": 28}, "history": []}
    storage.write_bytes(f"{run}/checkpoints/last.pt", encode_checkpoint(state))
    assert main([run]) == 0
    assert capsys.readouterr().out.splitlines() == [
        run,
        "no epoch finished yet: checkpoints/last.pt is at epoch 0, step 12 of 28; "
        "the same command continues it",
    ]
    # An epoch finished but metrics.jsonl could not be written: last.pt's history stands in for it.
    state.update(position={"epoch": 1, "step": 0}, history=[epoch(0, 0.5, 100.0, 0.1)])
    storage.write_bytes(f"{run}/checkpoints/last.pt", encode_checkpoint(state))
    text = report([run], None, draw=False)
    assert "best.pt: validation accuracy 50.00% at epoch 0" in text
    assert "no metrics.jsonl: the epochs are checkpoints/last.pt's history" in text
    storage.delete(f"{run}/checkpoints/last.pt")  # stopped before its first checkpoint
    assert "no epoch finished yet, and no checkpoint saved" in report([run], None)


def test_compiles_are_each_epochs_own_across_the_processes_of_a_resumed_run():
    """`compilations` is a process's running total; a resumed process counts from 0 again."""
    from tpustream.observe.report import compiles_per_epoch

    totals = [(5, True), (5, False), (7, False), (4, True), (4, False), (3, False), (3, False)]
    records = [
        {"compilations": total, **({"setup_seconds": 1.0} if first else {})} for total, first in totals
    ]
    # The second process's first epoch has setup_seconds; a third, without (no start time), counts less.
    assert compiles_per_epoch(records) == [5, 0, 2, 4, 0, 3, 0]


def test_the_weight_average_is_shown_beside_the_raw_weights_and_best_pt_is_named(two_runs, tmp_path):
    """ema.select_best=ema: best.pt's epoch is the average's best, both accuracies shown."""
    run = str(tmp_path / "ema")
    records = [epoch(0, 0.5, 100.0, 0.1), epoch(1, 0.0975, 100.0, 0.1)]
    records[0].update(ema_val_accuracy=0.3)
    records[1].update(ema_val_accuracy=0.6435)
    write_metrics(run, records)
    write_config(run, {"ema": {"decay": 0.99, "select_best": "ema"}, "data": {"num_workers": 0}})
    lines = report([run], None, draw=False).splitlines()
    assert lines[1].split()[:4] == ["epoch", "acc", "ema", "acc"]
    assert lines[3].split()[:3] == ["1", "9.8%", "64.3%"]
    assert lines[4] == (
        "best.pt: validation accuracy 64.35% at epoch 1 of the weight average, which best.pt follows "
        "(ema.select_best=ema); raw weights 9.75%"
    )
    header, *rows = report([*two_runs, run], None, draw=False).splitlines()[:4]
    assert header.split()[:6] == ["run", "best", "acc", "ema", "acc", "best.pt"]
    assert rows[0].split()[:5] == ["w0", "80.0%", "-", "1", "raw"]
    assert rows[2].split()[:5] == ["ema", "9.8%", "64.3%", "1", "ema"]


def synthetic_twin(tmp_path, name: str, rates: tuple[float, ...], **config) -> str:
    """A synthetic run (data.synthetic) of rates per epoch; config: its keys apart from data."""
    run = str(tmp_path / name)
    records = [{**epoch(e, 0.0, rate, 0.0), "synthetic": True} for e, rate in enumerate(rates)]
    for record in records:
        del record["val_accuracy"], record["val_top5"], record["val_loss"]
    write_metrics(run, records)
    write_config(run, {"output_dir": run, "data": {"synthetic": True, "num_workers": 0}, **config})
    return run


def test_a_run_given_with_its_synthetic_twin_shows_each_epochs_share_of_its_rate(two_runs, tmp_path):
    """How far each epoch ran from the device's own rate for the same step."""
    twin = synthetic_twin(tmp_path, "synthetic", (100.0, 250.0, 250.0), batch_size=8)
    text = report([two_runs[0], twin], None, draw=False)
    rows = text.splitlines()
    assert rows[1].split()[:6] == ["epoch", "acc", "top5", "loss", "samples/s", "of"]
    assert rows[2].split()[5] == "0.40" and rows[3].split()[5] == "0.80"  # 100 and 200 of 250
    assert "of synth.: the epoch's rate over its synthetic twin's 250.0 samples/s" in text
    # Over several runs, a column; a synthetic run of another step (batch) is nobody's twin.
    other = synthetic_twin(tmp_path, "other", (100.0, 400.0), batch_size=16)
    table = report([*two_runs, twin, other], None, draw=False).splitlines()
    assert table[0].split()[4:6] == ["of", "synth."]
    assert table[1].split()[:6] == ["w0", "80.0%", "200.0", "0.80", "-", "60.0%"]  # no input-bound measured
    assert table[3].split()[:6] == ["synthetic", "synth.", "250.0", "-", "-", "0.0%"]
    alone = report([two_runs[0], other], None, draw=False)
    assert "of synth." not in alone


def test_an_epoch_a_process_resumed_in_is_marked_and_its_start_is_not_a_recompile(tmp_path):
    """A run stopped twice: the epoch a process resumed in says so; its compiles are that process's first."""
    run = str(tmp_path / "resumed")
    lines = [epoch(number, 0.5, rate, 0.01) for number, rate in enumerate((1000.0, 120.0, 1000.0))]
    for line, process, trained_by, total in zip(
        lines, ("p2", "p3", "p3"), ("p1", "p3", "p3"), (1, 5, 5), strict=True
    ):
        line.update(process=process, train_process=trained_by, compilations=total)
    write_metrics(run, lines)
    write_config(
        run,
        {
            "output_dir": run,
            "data": {"num_workers": 2},
            "checkpoint": {"every_n_steps": 5, "asynchronous": True},
        },
    )
    text = report([run], None, draw=False)
    rows = text.splitlines()[2:5]
    assert [row.split()[-1] for row in rows] == ["1", "resumed", "0"]
    assert rows[1].split()[-2] == "5"
    assert "resumed: the first epoch a resumed process trained or ended; its samples/s and compiles" in text
    assert "compile-bound" not in text


def test_the_saving_advice_reads_the_runs_checkpoint_settings(tmp_path):
    run = str(tmp_path / "saving")
    lines = [epoch(number, 0.5, 1000.0, 0.01) for number in range(3)]
    for line in lines:
        line.update(
            checkpoint_stall_seconds=2.8, checkpoint_copy_seconds=2.7, checkpoint_writer_wait_seconds=0.0
        )
    write_metrics(run, lines)
    write_config(run, {"output_dir": run, "checkpoint": {"every_n_steps": 3, "asynchronous": True}})
    (finding,) = [line for line in report([run], None, draw=False).splitlines() if line.startswith("advice:")]
    assert finding.endswith("raise checkpoint.every_n_steps from 3 (or 0: epoch ends only)")
