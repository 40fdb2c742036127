"""Which epoch best.pt holds: the rule the trainer saves it by, read back by everything that reports it.

``ema.select_best`` chooses the accuracy that best.pt and early stopping
follow: the raw weights' (``val_accuracy``) or their average's
(``ema_val_accuracy``). train.py's last line, the replica's "finished" line,
the launcher's word on an earlier run and tpustream-report all name the epoch
``best_record`` picks, so none of them can name another epoch than best.pt's,
and each shows the other weights' accuracy beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tpustream import storage
from tpustream.config import BestOf

# The record field each choice of ema.select_best follows.
ACCURACY_FIELDS = {BestOf.raw: "val_accuracy", BestOf.ema: "ema_val_accuracy"}
# How each set of weights is named in a line.
WEIGHTS_NAMES = {BestOf.raw: "raw weights", BestOf.ema: "weight average"}


def select_best_of(config: Mapping[str, Any] | None) -> BestOf:
    """ema.select_best of a config as plain data (config.yaml, a checkpoint's); raw where it has none."""
    ema = (config or {}).get("ema") or {}
    return BestOf(ema.get("select_best") or BestOf.raw)


def read_select_best(output_dir: str) -> BestOf | None:
    """ema.select_best of the run in a folder, from its config.yaml (None where it has none)."""
    from omegaconf import OmegaConf

    url = storage.join(output_dir, "config.yaml")
    if not storage.exists(url):
        return None
    config = OmegaConf.to_container(OmegaConf.create(storage.read_bytes(url).decode()), resolve=False)
    return select_best_of(config) if isinstance(config, dict) else None


def selected_accuracy(record: Mapping[str, Any], select_best: BestOf | str) -> float | None:
    """The accuracy best.pt follows in an epoch's record or metrics (None: not evaluated that epoch)."""
    return record.get(ACCURACY_FIELDS[BestOf(select_best)])


def best_record(records: Iterable[Mapping[str, Any]], select_best: BestOf | str) -> Mapping[str, Any] | None:
    """The record of the epoch best.pt holds, or None where no epoch was evaluated.

    The trainer saves best.pt on a strict improvement only, so of equal
    accuracies the earliest epoch holds it; max() keeps the first maximum too.
    """
    evaluated = [r for r in records if selected_accuracy(r, select_best) is not None]
    return max(evaluated, key=lambda r: selected_accuracy(r, select_best), default=None)


def accuracy_text(record: Mapping[str, Any], weights: BestOf | str) -> str:
    """'64.35% (231/359)': one set of weights' validation accuracy in a record, counts where it has them."""
    prefix = "ema_" if BestOf(weights) == BestOf.ema else ""
    text = f"{100 * record[f'{prefix}val_accuracy']:.2f}%"
    correct, samples = record.get(f"{prefix}val_correct"), record.get("val_samples")
    return text if correct is None or samples is None else f"{text} ({correct}/{samples})"


def describe_best(record: Mapping[str, Any], select_best: BestOf | str, counts: bool = True) -> str:
    """The best epoch in words, naming the weights best.pt was chosen by and the other weights' accuracy.

    Without an average: '92.48% (1/2) at epoch 1'. With one: '64.35% (231/359)
    at epoch 7 of the weight average, which best.pt follows (ema.select_best=ema);
    raw weights 9.75% (35/359)'.
    """
    chosen = BestOf(select_best)
    other = BestOf.raw if chosen == BestOf.ema else BestOf.ema

    def accuracy(weights: BestOf) -> str:
        text = accuracy_text(record, weights)
        return text if counts else text.split(" ")[0]

    text = f"{accuracy(chosen)} at epoch {record['epoch']}"
    if selected_accuracy(record, other) is None:  # no average: nothing to choose between
        return text
    return (
        f"{text} of the {WEIGHTS_NAMES[chosen]}, which best.pt follows (ema.select_best={chosen.value}); "
        f"{WEIGHTS_NAMES[other]} {accuracy(other)}"
    )
