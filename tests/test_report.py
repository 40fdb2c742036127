"""EpochRecord: the one type of a metrics.jsonl line and a history entry; the epoch's log line."""

from __future__ import annotations

import json
import logging

import pytest

from tests.fake_runtime import FakeRuntime, FakeWorld, tiny_config
from tpustream.checkpoint import write_metrics
from tpustream.config import BestOf
from tpustream.training.epoch_report import EpochRecord, EpochReporter, read_epoch_records

# A metrics.jsonl line without the optional fields (top-5, EMA, time shares, process), in its key
# order: run folders written without them must still read back unchanged.
LINE = {
    "epoch": 1,
    "wall_time": 1795423849.4449675,
    "train_loss": 1.913942813873291,
    "train_samples": 768,
    "replica_steps": 12,
    "train_seconds": 12.318584203720093,
    "global_rate": 38.28175110703543,
    "train_filled": 0,
    "lr": 0.00170370868554659,
    "val_accuracy": 0.1671309192200557,
    "val_correct": 60,
    "val_samples": 359,
    "val_loss": 2.158695826623433,
    "val_seconds": 1.2268257141113281,
    "val_filled": 0,
    "compilations": 3,
    "epoch_seconds": 13.545409917831421,
    "setup_seconds": 6.286628484725952,
}
VAL_KEYS = ("val_accuracy", "val_correct", "val_samples", "val_loss", "val_seconds", "val_filled")


def test_a_line_reads_and_writes_back_unchanged_keys_order_included():
    record = EpochRecord.from_dict(LINE)
    assert record.evaluated and record.val_correct == 60
    assert list(record.to_dict().items()) == list(LINE.items())


def test_absent_fields_stay_absent():
    unevaluated = {k: v for k, v in LINE.items() if k not in (*VAL_KEYS, "setup_seconds")}
    record = EpochRecord.from_dict(unevaluated)
    assert not record.evaluated and record.setup_seconds is None
    assert record.to_dict() == unevaluated


def test_older_lines_without_epoch_seconds_and_newer_keys_still_read():
    older = {k: v for k, v in LINE.items() if k not in ("epoch_seconds", "setup_seconds")}
    assert EpochRecord.from_dict(older).epoch_seconds is None
    assert EpochRecord.from_dict({**LINE, "added_later": 1}).to_dict() == LINE


def test_a_line_missing_what_train_py_always_writes_is_refused():
    with pytest.raises(ValueError, match="not an epoch record.*train_loss"):
        EpochRecord.from_dict({k: v for k, v in LINE.items() if k != "train_loss"})


def test_metrics_jsonl_reads_back_as_records(tmp_path):
    unevaluated = {k: v for k, v in LINE.items() if k not in VAL_KEYS}
    write_metrics(str(tmp_path), [LINE, {**unevaluated, "epoch": 2}])
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][0] == LINE
    records = read_epoch_records(str(tmp_path))
    assert [r.epoch for r in records] == [1, 2] and records[0] == EpochRecord.from_dict(LINE)
    assert read_epoch_records(str(tmp_path / "nothing yet")) == []


def test_the_epoch_line_states_the_records_figures(tmp_path, caplog):
    reporter = EpochReporter(tiny_config(str(tmp_path)), {}, FakeRuntime(FakeWorld(1), 0))
    unevaluated = EpochRecord.from_dict({k: v for k, v in LINE.items() if k not in VAL_KEYS})
    with caplog.at_level(logging.INFO, logger="tpustream"):
        reporter.report_epoch(EpochRecord.from_dict(LINE), 0.1671309192200557, 1, 24, [38.3])
        reporter.report_epoch(unevaluated, 0.1671309192200557, 1, 24, [38.3])
    assert caplog.messages == [
        "Epoch=1 train: loss=1.9139 samples=768 (replica steps 12) skipped=0 GlobalRate=38.3 time=12.3s | "
        "val: accuracy=16.71% (60/359) loss=2.1587 skipped=0 | best=16.71% (epoch 1)",
        "Epoch=1 train: loss=1.9139 samples=768 (replica steps 12) skipped=0 GlobalRate=38.3 time=12.3s | "
        "val: not this epoch (eval_every)",
    ]


# LINE with top-5: val_top5 and its count after val_samples, where train.py writes them.
_AFTER_SAMPLES = list(LINE).index("val_samples") + 1
LINE_TOP5 = dict(
    [*list(LINE.items())[:_AFTER_SAMPLES], ("val_top5", 0.6128133704735376), ("val_top5_correct", 220)]
    + list(LINE.items())[_AFTER_SAMPLES:]
)


class RecordingTensorBoard:
    """The scalars an EpochReporter sends to TensorBoard, last value per name."""

    def __init__(self):
        self.values: dict[str, float] = {}

    def scalars(self, step, values):
        self.values.update(values)

    def sync(self):
        return True


def test_top5_reads_and_writes_back_and_older_lines_have_none():
    record = EpochRecord.from_dict(LINE_TOP5)
    assert (record.val_top5, record.val_top5_correct) == (0.6128133704735376, 220)
    assert list(record.to_dict().items()) == list(LINE_TOP5.items())
    older = EpochRecord.from_dict(LINE)
    assert older.val_top5 is None and older.val_top5_correct is None
    assert "val_top5" not in older.to_dict()


def test_the_epoch_line_and_tensorboard_show_top5_when_the_record_has_it(tmp_path, caplog):
    reporter = EpochReporter(tiny_config(str(tmp_path)), {}, FakeRuntime(FakeWorld(1), 0))
    reporter.tensorboard = RecordingTensorBoard()
    with caplog.at_level(logging.INFO, logger="tpustream"):
        reporter.report_epoch(EpochRecord.from_dict(LINE_TOP5), 0.1671309192200557, 1, 24, [38.3])
    assert caplog.messages == [
        "Epoch=1 train: loss=1.9139 samples=768 (replica steps 12) skipped=0 GlobalRate=38.3 time=12.3s | "
        "val: accuracy=16.71% (60/359) top5=61.28% loss=2.1587 skipped=0 | best=16.71% (epoch 1)",
    ]
    assert reporter.tensorboard.values["epoch/val_top5"] == 0.6128133704735376
    reporter.tensorboard = RecordingTensorBoard()
    reporter.report_epoch(EpochRecord.from_dict(LINE), 0.1671309192200557, 1, 24, [38.3])
    assert "epoch/val_top5" not in reporter.tensorboard.values


def test_the_epoch_line_shows_the_weight_average_and_which_evaluation_chose_the_best(tmp_path, caplog):
    ema = {"ema_val_accuracy": 0.2, "ema_val_correct": 72, "ema_val_top5": 0.65, "ema_val_loss": 2.01}
    reporter = EpochReporter(
        tiny_config(str(tmp_path), **{"ema.decay": 0.9, "ema.select_best": BestOf.ema}),
        {},
        FakeRuntime(FakeWorld(1), 0),
    )
    with caplog.at_level(logging.INFO, logger="tpustream"):
        reporter.report_epoch(EpochRecord.from_dict({**LINE_TOP5, **ema}), 0.2, 1, 24, [38.3])
    assert caplog.messages == [
        "Epoch=1 train: loss=1.9139 samples=768 (replica steps 12) skipped=0 GlobalRate=38.3 time=12.3s | "
        "val: accuracy=16.71% (60/359) top5=61.28% loss=2.1587 skipped=0 | "
        "ema: accuracy=20.00% top5=65.00% loss=2.0100 | best ema=20.00% (epoch 1)",
    ]


def test_the_evaluation_line_of_eval_only_shows_top5(tmp_path, caplog):
    reporter = EpochReporter(tiny_config(str(tmp_path)), {}, FakeRuntime(FakeWorld(1), 0))
    with caplog.at_level(logging.INFO, logger="tpustream"):
        reporter.report_evaluation(1, EpochRecord.from_dict(LINE_TOP5).to_dict())
    assert caplog.messages == [
        "evaluation of the checkpoint from epoch 1: accuracy=16.71% (60/359) top5=61.28% loss=2.1587"
    ]


def test_a_record_names_the_process_that_made_it_and_a_line_read_back_keeps_its_own():
    from tpustream.observe.timing import process_token

    made = EpochRecord(**{k: v for k, v in LINE.items() if k != "setup_seconds"})
    assert made.process == process_token() and made.to_dict()["process"] == process_token()
    assert EpochRecord.from_dict(LINE).process is None  # written before records named it: not the reader
    assert EpochRecord.from_dict({**LINE, "process": "1-abc"}).to_dict()["process"] == "1-abc"
