"""The epoch best.pt holds, by ema.select_best, as every report names it."""

from __future__ import annotations

import pytest

from tpustream.checkpoint import write_config
from tpustream.config import BestOf
from tpustream.observe.best import best_record, describe_best, read_select_best, select_best_of


def epoch(number: int, raw: int, ema: int | None = None) -> dict:
    """A metrics.jsonl line: `raw` (and `ema`) correct of 359 validation images."""
    record = {"epoch": number, "val_accuracy": raw / 359, "val_correct": raw, "val_samples": 359}
    if ema is not None:
        record.update(ema_val_accuracy=ema / 359, ema_val_correct=ema)
    return record


# The run: the raw weights peak at epoch 1, their average (which best.pt follows) at epoch 2.
HISTORY = [epoch(0, 20, 10), epoch(1, 35, 100), epoch(2, 30, 231), {"epoch": 3, "train_loss": 1.0}]


def test_the_best_epoch_follows_the_selected_weights_and_skips_unevaluated_ones():
    assert best_record(HISTORY, BestOf.raw)["epoch"] == 1
    assert best_record(HISTORY, "ema")["epoch"] == 2
    assert best_record(HISTORY[3:], "raw") is None
    # best.pt moves on a strict improvement only: of equal accuracies, the first epoch holds it.
    assert best_record([epoch(0, 5, 9), epoch(1, 5, 9)], "ema")["epoch"] == 0


def test_the_best_epoch_in_words_names_the_weights_and_shows_the_others():
    assert describe_best(epoch(4, 332), "raw") == "92.48% (332/359) at epoch 4"  # no average
    assert describe_best(best_record(HISTORY, "ema"), "ema") == (
        "64.35% (231/359) at epoch 2 of the weight average, which best.pt follows (ema.select_best=ema); "
        "raw weights 8.36% (30/359)"
    )
    assert describe_best(best_record(HISTORY, "raw"), "raw", counts=False) == (
        "9.75% at epoch 1 of the raw weights, which best.pt follows (ema.select_best=raw); "
        "weight average 27.86%"
    )


@pytest.mark.parametrize(
    "config, chosen",
    [({}, BestOf.raw), ({"ema": {"decay": 0.9}}, BestOf.raw), ({"ema": {"select_best": "ema"}}, BestOf.ema)],
)
def test_select_best_is_read_from_plain_config(config, chosen, tmp_path):
    assert select_best_of(config) == chosen
    write_config(str(tmp_path), config)
    assert read_select_best(str(tmp_path)) == chosen
    assert read_select_best(str(tmp_path / "elsewhere")) is None
