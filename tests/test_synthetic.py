"""data.synthetic: the run's own step on one device-resident batch, no input; its rate, marked synthetic."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from tests.conftest import run_train
from tests.fake_runtime import tiny_config, tiny_model
from tpustream import storage
from tpustream.data.read.synthetic_batch import SyntheticSource, stand_in_manifest
from tpustream.errors import ConfigError
from tpustream.launch import prepare
from tpustream.launch.synthetic import make_synthetic_sources
from tpustream.runtime.native import NativeRuntime

SHAPES = ("data.num_classes=10", "data.image_size=32", "data.channels=3")


@pytest.fixture
def prepared(compose_config, tmp_path):
    def run(*overrides: str):
        return prepare(compose_config(f"output_dir={tmp_path}/run", "data.synthetic=true", *overrides))

    return run


def test_without_shards_the_batch_takes_the_configs_shapes(prepared, caplog):
    caplog.set_level(logging.INFO)
    plan = prepared("data.train_shards=null", *SHAPES)
    assert plan.train.shards == [] and plan.train.image_size == (32, 32) and plan.train.num_classes == 10
    assert plan.cfg.eval_every == 0 and plan.config_dict["eval_every"] == 0 and plan.resume_url is None
    assert "100 steps an epoch (no shards: data.train_shards=null)" in caplog.text
    # A folder that is not there is no shards either (the digits config's, on a fresh clone).
    assert prepared("data.root=/nonexistent/digits", *SHAPES).train.shards == []


def test_without_shards_it_names_the_keys_to_set(prepared):
    with pytest.raises(ConfigError) as error:
        prepared("data.train_shards=null", "data.num_classes=10")
    assert str(error.value) == (
        "data.synthetic without shards (data.train_shards=null) takes the batch's shapes from the config: "
        "set data.image_size, data.channels"
    )


def test_with_shards_it_plans_from_the_manifest_and_reads_no_sample(prepared, digits_root, monkeypatch):
    def no_reads(url):
        raise AssertionError(f"read {url}")

    monkeypatch.setattr(storage, "open_read", no_reads)
    plan = prepared(f"data.root={digits_root}")
    assert plan.train.num_samples == 1438 and plan.train.image_size == (32, 32) and plan.train.channels == 3
    assert plan.val.num_samples == 1438  # the training split's shapes: nothing is evaluated


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval_only=true"], "eval_only has nothing to evaluate it on"),
        (["early_stop_patience=2"], "early_stop_patience would never act"),
        (["resume=/some/last.pt"], "resume=/some/last.pt has nothing to continue"),
    ],
)
def test_what_a_synthetic_run_cannot_do_is_one_line(prepared, overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepared("data.train_shards=null", *SHAPES, *overrides)


def test_it_neither_continues_nor_overwrites_a_run(prepared, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.pt").write_bytes(b"a real run's")
    with pytest.raises(ConfigError) as error:
        prepared("data.train_shards=null", *SHAPES)
    message = str(error.value)
    assert "a synthetic run (data.synthetic) would overwrite (checkpoints/last.pt): choose another" in message
    assert "resume=auto" not in message


def synthetic_job(tmp_path, **changes):
    """A synthetic run of the tiny model on NativeRuntime (cpu_eager's), in this process; its trainer."""
    from tpustream.training import make_trainer

    settings = {"data.synthetic": True, "data.synthetic_steps": 3, "eval_every": 0}
    cfg = tiny_config(str(tmp_path), **{**settings, **changes})  # eval_every as prepare sets it
    runtime = NativeRuntime(0, 1, 0, torch.device("cpu"))
    train, val = make_synthetic_sources(cfg, stand_in_manifest(4, 8, 3), runtime, cfg.batch_size)
    placed = []
    place = runtime.place_batch
    runtime.place_batch = lambda batch: placed.append(batch) or place(batch)
    trainer = make_trainer(cfg, {"seed": cfg.seed}, runtime, tiny_model(), train, val)
    return trainer, trainer.fit(), placed


def test_the_trainer_steps_on_one_resident_batch_and_writes_no_checkpoint(tmp_path):
    changes = {"augment.cutmix_alpha": 1.0, "ema.decay": 0.9, "micro_batches": 2, "epochs": 3}
    trainer, summary, placed = synthetic_job(tmp_path, **changes)
    batch = trainer.train_loader.batch
    assert len(placed) == 1  # once, for every epoch
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (4, 3, 8, 8)
    assert "mix_lam" in batch and int(batch["label"].max()) < 4 and bool((batch["real"] == 1).all())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["synthetic"] for r in records] == [True] * 3 and not any("val_accuracy" in r for r in records)
    assert [r["replica_steps"] for r in records] == [3] * 3 and all(r["global_rate"] > 0 for r in records)
    assert not os.path.exists(tmp_path / "checkpoints")
    assert summary["history"][-1]["synthetic"] is True and trainer.global_step == 9


def test_the_batch_is_the_seeds(tmp_path):
    (first, _, _), (second, _, _) = synthetic_job(tmp_path / "a"), synthetic_job(tmp_path / "b")
    for name, tensor in first.train_loader.batch.items():
        assert torch.equal(tensor, second.train_loader.batch[name]), name


def test_a_source_yields_its_batch_steps_times():
    source = SyntheticSource({"label": torch.zeros(2)}, 5)
    source.set_epoch(1, skip_batches=2)
    assert len(source) == 3 and [b["label"] is source.batch["label"] for b in source] == [True] * 3
    source.raise_if_incomplete("train")


def test_its_folder_is_reported_as_synthetic_and_not_exported(tmp_path, capsys):
    from tpustream.launch.resume_checks import check_fresh_start
    from tpustream.models.export import main as export_main
    from tpustream.observe.report import report

    synthetic_job(tmp_path, epochs=2)
    text = report([str(tmp_path)], None, draw=False)
    assert "synthetic: " in text and "samples/s (steady epoch 1), step " in text and "best.pt" not in text
    assert export_main([str(tmp_path)]) == 2
    assert "is a synthetic run (data.synthetic)" in capsys.readouterr().err
    # A real run there: nothing to continue, so no "resume=auto" advice.
    with pytest.raises(ConfigError) as error:
        check_fresh_start(tiny_config(str(tmp_path), resume=None))
    assert "holds a run (a synthetic run, 2 epoch(s); synthetic: " in str(error.value)
    assert "choose another output_dir, or resume=overwrite" in str(error.value)


@pytest.mark.slow
def test_train_py_measures_the_step_on_xla_devices_without_shards(tmp_path):
    """strategy=spmd on 4 XLA CPU devices: the batch sharded over the mesh once, a graph per step, no more."""
    run = tmp_path / "run"
    result = run_train(
        "data.synthetic=true",
        "data.train_shards=null",
        *SHAPES,
        "data.synthetic_steps=4",
        "epochs=2",
        "strategy=spmd",
        "accelerator.num_devices=4",
        "batch_size=8",
        "augment.cutmix_alpha=1.0",  # the device augmentation, from draws the resident batch carries
        "ema.decay=0.9",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    last_line = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"synthetic: [\d.]+ samples/s \(steady epoch 1\), step [\d.]+ ms; "
        rf"no checkpoints \(data.synthetic\), metrics in {run}",
        last_line,
    ), last_line
    assert "finished: synthetic: " in result.stderr and "val: none (data.synthetic)" in result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["synthetic"], r["train_samples"]) for r in records] == [(True, 128)] * 2
    assert records[1]["compilations"] == records[0]["compilations"]  # one batch, one step graph
    assert not any("val_accuracy" in r for r in records) and not (run / "checkpoints").exists()
