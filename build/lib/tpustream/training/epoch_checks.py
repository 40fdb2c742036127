"""Checks on an epoch's reduced metrics before anything is saved: a run that did not really train stops.

Every replica computes the same reduced numbers, so every replica raises the
same error at the same point and none is left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpustream.errors import DataError

SPLITS = (("train", "train_samples", "train_filled"), ("validation", "val_samples", "val_filled"))
# Shards named in the error (the replicas' warnings name every bad sample).
NAMED_SHARDS = 3


def first_distinct(urls: Iterable[str], limit: int = NAMED_SHARDS) -> list[str]:
    """The first `limit` distinct URLs, in order."""
    return list(dict.fromkeys(urls))[:limit]


def check_epoch(
    epoch: int,
    metrics: Mapping[str, Any],
    max_bad_fraction: float,
    stop_on_nonfinite_loss: bool,
    bad_shards: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """DataError if too much of a split was bad or missing, or if the loss is not finite.

    The counts are of real samples only: "*_filled" the ones bad data took
    out, "*_samples" the ones used, so together they are the split's samples
    read this epoch. Padding (the wrap-around that fills the last global
    batch) is in neither, bad or good.

    bad_shards: per split, the first shards where bad data was met (named in the error).
    """
    for split, good_key, bad_key in SPLITS:
        if good_key not in metrics:
            continue  # not evaluated this epoch
        bad = int(metrics[bad_key])
        total = bad + int(metrics[good_key])
        if total and bad / total > max_bad_fraction:
            shards = list((bad_shards or {}).get(split, ()))
            where = f"first in {', '.join(shards)}; " if shards else ""
            raise DataError(
                f"{split}: {bad} of {total} samples ({100 * bad / total:.1f}%) were bad or missing "
                f"in epoch {epoch}, over data.max_bad_fraction={max_bad_fraction:g} ({where}the replicas' "
                "'skipping bad data' warnings name each sample; raise the limit to train anyway)"
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
