"""Checks on an epoch's reduced metrics before anything is saved: a run that did not really train stops.

Every replica computes the same reduced numbers, so every replica raises the
same error at the same point and none is left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tpustream.errors import DataError

SPLITS = (("train", "train_samples", "train_filled"), ("validation", "val_samples", "val_filled"))


def check_epoch(
    epoch: int, metrics: Mapping[str, Any], max_bad_fraction: float, stop_on_nonfinite_loss: bool
) -> None:
    """DataError if too much of a split was bad or missing, or if the loss is not finite."""
    for split, real_key, filled_key in SPLITS:
        if real_key not in metrics:
            continue  # not evaluated this epoch
        filled, real = int(metrics[filled_key]), int(metrics[real_key])
        planned = filled + real
        if planned and filled / planned > max_bad_fraction:
            raise DataError(
                f"{split}: {filled} of {planned} samples ({100 * filled / planned:.1f}%) were bad or missing "
                f"in epoch {epoch}, over data.max_bad_fraction={max_bad_fraction:g}; the replicas' "
                "'skipping bad data' warnings name each shard and sample (raise the limit to train anyway)"
            )
    if stop_on_nonfinite_loss:
        for key in ("train_loss", "val_loss"):
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                name = key.replace("_", " ")
                raise DataError(
                    f"{name} is {value} in epoch {epoch}: the run diverged (too high optim.lr?); checkpoints "
                    "keep the last finite epoch (set stop_on_nonfinite_loss=false to go on)"
                )
