"""ema.decay: the weight average against timm's, in the trainer's loop, in checkpoints and on resume.

In process on the CPU (tests/fake_runtime.py); the XLA side (updated inside
the step, evaluated by the same graph) is in test_models' library test.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torch.nn as nn

from tests.fake_runtime import FakeRuntime, FakeWorld, tiny_config
from tpustream.checkpoint import BEST, LAST, checkpoint_url, load_checkpoint, read_metrics
from tpustream.config import BestOf, EmaConfig
from tpustream.errors import ConfigError
from tpustream.observe.best import best_record
from tpustream.training.ema import WeightAverage


def small_bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


@pytest.mark.parametrize("warmup", [False, True])
def test_the_average_follows_timms_model_ema_v3_update_by_update(warmup):
    timm_ema = pytest.importorskip("timm.utils.model_ema")
    model = small_bn_model()
    theirs = timm_ema.ModelEmaV3(model, decay=0.9, use_warmup=warmup, warmup_power=0.75)
    cfg = EmaConfig(decay=0.9, warmup=warmup, warmup_power=0.75)
    runtime = FakeRuntime(FakeWorld(1), 0)
    mine = WeightAverage(cfg, copy.deepcopy(model), runtime, updates=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(1, 8):
        model.train()
        model(torch.randn(5, 3, 8, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        theirs.update(model, step=step)  # timm's train.py: the count of updates so far
        mine.update(model)
        for name, tensor in theirs.module.state_dict().items():
            if tensor.is_floating_point():
                got = mine.module.state_dict()[name]
                torch.testing.assert_close(got, tensor, rtol=1e-6, atol=1e-7, msg=f"{name} at {step}")
    # The first update copies; later ones lag behind the weights.
    assert not torch.equal(mine.module[0].weight, model[0].weight)


def test_a_resumed_average_continues_the_warmup_where_it_was():
    cfg = EmaConfig(decay=0.999, warmup=True)
    runtime = FakeRuntime(FakeWorld(1), 0)
    fresh = WeightAverage(cfg, small_bn_model(), runtime, updates=0)
    resumed = WeightAverage(cfg, small_bn_model(), runtime, updates=10)
    fresh.updates += 11
    resumed.updates += 1
    assert fresh.weight().item() == resumed.weight().item() == pytest.approx(11 ** (-2 / 3))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"decay": 1.0}, "ema.decay must be in [0, 1)"),
        ({"decay": -0.1}, "ema.decay must be in [0, 1)"),
        ({"decay": 0.99, "warmup_power": 0.0}, "ema.warmup_power must be a positive number"),
        ({"select_best": BestOf.ema}, "ema.select_best=ema needs an average"),
    ],
)
def test_ema_fields_are_checked(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        EmaConfig(**changes).check()


def test_the_trainer_evaluates_both_and_checkpoints_the_average(fake_job, tmp_path):
    run = str(tmp_path / "run")
    job = fake_job(tiny_config(run, **{"ema.decay": 0.9}), world_size=2)
    assert all(isinstance(r, dict) for r in job.results), job.results
    records = read_metrics(run)
    for record in records:
        assert {"ema_val_accuracy", "ema_val_correct", "ema_val_top5", "ema_val_loss"} <= set(record)
        assert record["ema_val_accuracy"] == record["ema_val_correct"] / record["val_samples"]
    last = load_checkpoint(checkpoint_url(run, LAST))
    assert last["ema"].keys() == last["model"].keys()
    assert any(not torch.equal(last["ema"][k], last["model"][k]) for k in last["model"])
    # Both replicas hold the same average (it follows identical weights).
    for mine, theirs in zip(*(t.ema.module.parameters() for t in job.trainers), strict=True):
        assert torch.equal(mine, theirs)


def test_best_follows_the_selected_weights(fake_job, tmp_path):
    run = str(tmp_path / "run")
    cfg = tiny_config(run, epochs=3, **{"ema.decay": 0.99, "ema.select_best": BestOf.ema})
    job = fake_job(cfg)
    (summary,) = job.results
    records = read_metrics(run)
    best = max(range(3), key=lambda e: (records[e]["ema_val_accuracy"], -e))
    assert (summary["best_epoch"], summary["best_accuracy"]) == (best, records[best]["ema_val_accuracy"])
    saved = load_checkpoint(checkpoint_url(run, BEST))
    assert saved["epoch"] == best
    # Every report names best.pt's epoch by the same rule.
    assert best_record(records, cfg.ema.select_best)["epoch"] == best
    # The average evaluated is the average saved: its accuracy, recomputed from best.pt.
    trainer = job.master
    trainer.ema.module.load_state_dict(saved["ema"])
    again = trainer.evaluator.run(trainer.ema.module, best, trainer.autocast, lambda index: False, False)
    assert again["val_correct"] == records[best]["ema_val_correct"]


def test_a_run_stopped_mid_epoch_resumes_its_average_bit_for_bit(fake_job, tmp_path):
    def config(run):
        return tiny_config(run, **{"ema.decay": 0.95, "ema.warmup": True})

    straight = str(tmp_path / "straight")
    fake_job(config(straight), world_size=2)
    run = str(tmp_path / "run")
    fake_job(config(run), world_size=2, stop_at=(1, "train", 1, 3))
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert state["position"] == {"epoch": 1, "step": 4}
    fake_job(config(run), world_size=2, resume_from=(state, checkpoint_url(run, LAST)))
    got, want = load_checkpoint(checkpoint_url(run, LAST)), load_checkpoint(checkpoint_url(straight, LAST))
    for name, tensor in want["ema"].items():
        assert torch.equal(got["ema"][name], tensor), name
    assert read_metrics(run)[-1]["ema_val_loss"] == read_metrics(straight)[-1]["ema_val_loss"]


def test_turning_ema_on_for_a_run_without_one_starts_from_its_weights(fake_job, tmp_path, caplog):
    run = str(tmp_path / "run")
    fake_job(tiny_config(run, epochs=1))
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert "ema" not in state  # the format of runs without a weight average is unchanged
    with caplog.at_level(logging.INFO, logger="tpustream"):
        fake_job(tiny_config(run, epochs=2, **{"ema.decay": 0.9}), resume_from=(state, "last.pt"))
    assert "last.pt holds no weight average: ema starts from its weights" in caplog.text
    assert "ema_val_accuracy" in read_metrics(run)[-1] and "ema_val_accuracy" not in read_metrics(run)[0]
