"""What the trainer needs from a split's batches: the ``EpochSource`` protocol.

The trainer sees a split only through this interface, never through the
DataLoader or the dataset behind it, so the loop can be driven by any source
of batches (``tpustream.data.ShardLoader`` in a run, the loader any training
loop can use, ``data.read.synthetic_batch.SyntheticSource`` under
data.synthetic, in-memory batches in tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch


class EpochSource(Protocol):
    """One replica's batches of one split, one epoch (or the rest of one) per pass.

    Each batch is {"image": uint8 (B, C, H, W), "label": int64 (B,), "real":
    bool (B,)}, True for the samples that count in loss and metrics. A source
    whose batch stays on the device says so with ``resident = True`` and a
    ``place(move)`` method (data.read.synthetic_batch; runtime.resident).
    """

    # Places bad data left empty in the last pass (a report, not used in training).
    filled: int
    # The last pass's first shards with bad data.
    bad_shards: list[str]
    # The last pass's real sample ids, per batch (recorded only when asked for).
    sample_ids: list[np.ndarray]

    @property
    def steps(self) -> int:
        """Batches of a whole epoch of this replica: the same on every replica."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch the next pass yields, from its batch skip_batches on (before iterating)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def state_dict(self, position: tuple[int, int]) -> dict[str, Any]:
        """The order's state at (epoch, step) trained: a checkpoint's data plan (training.epoch_order).

        What the order depends on, under training.epoch_order's keys, and the
        position; a source of a run that never saves (data.synthetic) has none.
        """

    def raise_if_incomplete(self, split: str) -> None:
        """Raise if the last pass yielded fewer batches than planned (the other replicas would wait)."""
