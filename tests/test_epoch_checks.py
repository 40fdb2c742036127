"""An epoch that did not really train stops the run before anything is saved."""

from __future__ import annotations

import math

import pytest

from tpustream.errors import DataError
from tpustream.training.epoch_checks import check_epoch, first_distinct

GOOD = {
    "train_loss": 0.5,
    "train_samples": 990,
    "train_filled": 10,
    "val_loss": 0.4,
    "val_samples": 100,
    "val_filled": 0,
}


def test_a_healthy_epoch_passes_and_unevaluated_validation_is_not_checked():
    check_epoch(0, GOOD, 0.01, True)
    check_epoch(0, {k: v for k, v in GOOD.items() if not k.startswith("val")}, 0.01, True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"train_samples": 0, "train_filled": 1472},
            r"train: 1472 of 1472 samples \(100.0%\) were bad or missing in epoch 3",
        ),
        (
            {"val_samples": 90, "val_filled": 10},
            r"validation: 10 of 100 samples \(10.0%\).*data.max_bad_fraction=0.01",
        ),
        ({"train_loss": math.nan}, r"train loss is nan in epoch 3: the run diverged \(too high optim.lr\?\)"),
        ({"val_loss": math.inf}, "val loss is inf in epoch 3"),
    ],
)
def test_bad_data_past_the_limit_and_a_nonfinite_loss_stop_the_run(changes, message):
    with pytest.raises(DataError, match=message):
        check_epoch(3, {**GOOD, **changes}, 0.01, True)


def test_the_error_names_the_first_bad_shards():
    shards = {"train": ["gs://b/train-000004.tar", "gs://b/train-000009.tar"], "validation": []}
    with pytest.raises(DataError, match=r"\(first in gs://b/train-000004.tar, gs://b/train-000009.tar; the"):
        check_epoch(3, {**GOOD, "train_filled": 500}, 0.01, True, shards)
    assert first_distinct(["a", "b", "a", "c", "d"]) == ["a", "b", "c"]


def test_the_limits_are_settings():
    check_epoch(3, {**GOOD, "train_samples": 0, "train_filled": 1000}, 1.0, True)
    check_epoch(3, {**GOOD, "train_loss": math.nan}, 0.01, False)
