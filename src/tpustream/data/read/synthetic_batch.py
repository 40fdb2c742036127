"""data.synthetic: one batch of the data's shapes, made once per replica and kept on the device.

A synthetic run trains the run's own step on this batch, over and over, with
no storage reads, decoding, host augmentation or host-to-device copies, so
its rate is what the accelerator gives the configuration with free input:
the yardstick a real run's rate is compared with (``1 - real / synthetic`` is
the share of the time its input cost). ``SyntheticSource`` is the trainer's
``EpochSource``; it says its batch is ``resident``, and the runtimes put it on
the device once and hand it to every step as it is (runtime.resident).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from tpustream.data.format.manifest import ShardManifest
from tpustream.errors import DataError

# Keeps the synthetic batch's generator apart from any other use of the seed.
SALT = 0x73796E74  # "synt"
# Steps an epoch without shards to take the count from, unless data.synthetic_steps says.
DEFAULT_STEPS = 100


def stand_in_manifest(num_classes: int, image_size: int, channels: int) -> ShardManifest:
    """The training split a synthetic run without shards plans from: the config's shapes, no shards."""
    return ShardManifest(
        "train", [str(c) for c in range(num_classes)], (image_size, image_size), channels, "synthetic"
    )


def make_synthetic_batch(
    shape: tuple[int, int, int, int],
    num_classes: int,
    seed: int,
    rank: int,
    draws: Callable[[int, np.ndarray], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """A training batch as the loader makes one: uint8 images uniform in 0..255, labels in range, all real.

    shape: (batch, channels, height, width). Deterministic from (seed, rank),
    each replica its own. draws: augment.draws.BatchDraws, the device
    augmentation's for these samples (ids rank * batch onwards, epoch 0).
    """
    generator = np.random.default_rng([seed, SALT, rank])
    count = shape[0]
    batch = {
        "image": torch.from_numpy(generator.integers(0, 256, shape, dtype=np.uint8)),
        "label": torch.from_numpy(generator.integers(0, num_classes, count, dtype=np.int64)),
        "real": torch.ones(count, dtype=torch.bool),
    }
    if draws is not None:
        batch.update(draws(0, np.arange(rank * count, (rank + 1) * count)))
    return batch


class SyntheticSource:
    """One replica's epochs of one batch: ``steps`` times the same batch a pass (an EpochSource).

    Nothing is read, so nothing is bad: ``filled`` stays 0 and ``bad_shards``
    empty. Sample ids are not recorded (there are no samples to log).
    """

    # Its batch is kept on the device: the runtime places it once and yields it as it is.
    resident = True

    def __init__(self, batch: dict[str, torch.Tensor], steps: int):
        self.batch = batch
        self._steps = steps
        self.placed = False
        self.skip = self.batches = 0
        self.filled = 0
        self.bad_shards: list[str] = []
        self.sample_ids: list[np.ndarray] = []

    @property
    def steps(self) -> int:
        return self._steps

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.skip = skip_batches

    def __len__(self) -> int:
        return self._steps - self.skip

    def place(self, move: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
        """Put the batch where the steps run, with the runtime's own copy; once, for every epoch."""
        if not self.placed:
            self.batch, self.placed = move(self.batch), True

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.batches = 0
        for _ in range(len(self)):
            self.batches += 1
            yield self.batch

    def raise_if_incomplete(self, split: str) -> None:
        if self.batches != len(self):
            raise DataError(f"{split}: the synthetic source yielded {self.batches} of {len(self)} batches")
