"""ShardLoader: tpustream's input pipeline for any training loop, its position a small dict.

    from tpustream.data import ShardLoader

    loader = ShardLoader("gs://bucket/imagenet/train", batch_size=256, image_size=224, num_workers=8)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:  # image uint8 (B, C, H, W); label, sample_id int64, real bool (B,); key: str x B
            ...
        state = loader.state_dict()  # JSON-serialisable, a few hundred bytes: keep it in the checkpoint
    loader.load_state_dict(state)  # on any rank and number of ranks: the same global batches go on

It resolves the split once (shards, their sample counts: a manifest, other tools'
counts, or counted now by rank 0), plans the epoch for every rank alike (equal
steps; samples that only pad the last global batch come with real == False), and
cuts the training order into canonical streams (data.read.layout.CanonicalPartition):
the global batches are a function of the data, the seed and the global batch
only, so a state taken at any step continues on any number of ranks that divides
the streams, with the same global batch. The state names the dataset, the seed and
the partition it belongs to, and a state of another one is refused in one line.

It is train.py's loader too (``ShardLoader.of_split``, the run's data.* section
whole): the trainer reads its batches (training.source.EpochSource), and a
checkpoint's data plan is its ``state_dict`` at the step trained.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from tpustream.config import AugmentConfig, DataConfig, LastBatch, OnError, TrainCrop
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import CanonicalPartition, EpochLayout
from tpustream.data.read.loader import CountingLoader, close_loaders, make_loader
from tpustream.data.read.partition import choose_partition
from tpustream.data.read.stream import ShardStream, epoch_layout
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.split import load_split, load_split_counted_elsewhere
from tpustream.errors import ConfigError
from tpustream.observe.timing import BatchWaits

STATE_FORMAT = "tpustream.ShardLoader/2"
# The first format: the canonical partition under "partition" ({"streams", "stream_buffer"} or None).
FIRST_STATE_FORMAT = "tpustream.ShardLoader/1"


def distributed_rank_and_size() -> tuple[int, int]:
    """torch.distributed's (rank, world size) when a process group is up, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _choice(kind: type[Enum], value: str, name: str) -> Enum:
    """value as one of kind's members; a ConfigError naming the argument and the choices otherwise."""
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise ConfigError(f"ShardLoader: {name}={value!r}; expected one of {choices}") from None


def dataset_fingerprint(manifest: ShardManifest) -> str:
    """What the split is, in 16 hex digits: its shards' URLs and sample counts, in order."""
    listed = json.dumps([[shard.url, shard.samples] for shard in manifest.shards])
    return hashlib.sha256(listed.encode()).hexdigest()[:16]


class ShardLoader:
    """Batches of one split for a training loop of your own: exact, equal on every rank, resumable anywhere.

    shards: a folder or gs:// prefix of tar shards, a brace pattern, or a list of them
    (whatever data.train_shards takes). batch_size: this rank's. rank and world_size
    default to torch.distributed's (0 and 1 without a process group). train: shuffled
    training order with pad-crop or random-resized crops and flips; False: the split once,
    in order, with the evaluation crop, every sample exactly once across the ranks (the
    last batches padded, real == False). image_size: the crops' side (any stored size with
    crop="random_resized"); None: the images' own size. Normalisation is the caller's (on
    the device, where it is cheap).
    """

    def __init__(
        self,
        shards: str | Sequence[str],
        *,
        batch_size: int,
        train: bool = True,
        image_size: int | None = None,
        crop: str = "pad_crop",
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 2,
        seed: int = 0,
        shuffle_buffer: int = 2000,
        streams: int | str = "auto",
        num_classes: int | None = None,
        image_key: str | None = None,
        label_key: str = "cls",
        prefetch_factor: int = 4,
        on_error: str = "skip",
    ):
        found_rank, found_size = distributed_rank_and_size()
        rank = found_rank if rank is None else rank
        world_size = found_size if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"ShardLoader: rank {rank} is outside a world of {world_size}")
        if batch_size < 1:
            raise ConfigError(f"ShardLoader: batch_size must be at least 1, got {batch_size}")
        data = dataclasses.replace(
            DataConfig(root=""),
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            shuffle_buffer=shuffle_buffer,
            streams=streams,
            last_batch=LastBatch.pad,
            on_error=_choice(OnError, on_error, "on_error"),
            train_crop=_choice(TrainCrop, crop, "crop"),
            image_size=image_size,
            num_classes=num_classes,
            image_key=image_key,
            label_key=label_key,
        )
        manifest = resolve_split(shards, "train" if train else "val", SplitOptions.from_config(data), rank)
        partition = (
            choose_partition(
                streams, world_size, batch_size, num_workers, len(manifest.shards), shuffle_buffer
            )
            if train
            else None
        )
        self._set_up(
            manifest, data, batch_size, rank, world_size, train, seed, partition, {}, {"ids_in_batch": True}
        )

    @classmethod
    def of_split(
        cls,
        manifest: ShardManifest,
        data: DataConfig,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        train: bool,
        seed: int,
        partition: CanonicalPartition | None,
        augment: AugmentConfig | None = None,
        augment_group: int = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        record_ids: bool = False,
        pin_device: torch.device | None = None,
        decode_device: torch.device | None = None,
    ) -> ShardLoader:
        """The loader of a split already resolved, its data.* section whole: tpustream's trainer's.

        Beyond the public loader: augment (training), whose draws each batch then
        carries (augment.draws), augment_group one device's batch within it;
        worker_init_fn for each worker; record_ids keeps each pass's real sample
        ids (``sample_ids``, for debug.sample_log_dir) instead of a batch field;
        pin_device, the GPU the batches go to (page-locked on the host);
        decode_device, where data.decode=device decodes.
        """
        loader = cls.__new__(cls)
        stream_options = {"augment": augment, "augment_group": augment_group}
        loader_options = {
            "worker_init_fn": worker_init_fn,
            "record_ids": record_ids,
            "pin_device": pin_device,
            "decode_device": decode_device,
        }
        loader._set_up(
            manifest,
            data,
            batch_size,
            rank,
            world_size,
            train,
            seed,
            partition,
            stream_options,
            loader_options,
        )
        return loader

    def _set_up(
        self,
        manifest: ShardManifest,
        data: DataConfig,
        batch_size: int,
        rank: int,
        world_size: int,
        train: bool,
        seed: int,
        partition: CanonicalPartition | None,
        stream_options: dict[str, Any],
        loader_options: dict[str, Any],
    ) -> None:
        self.manifest, self.data = manifest, data
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.train, self.seed, self.partition = train, seed, partition
        # What else ShardStream and make_loader are given (of_split's extras, the public ids).
        self._stream_options, self._loader_options = stream_options, loader_options
        self.epoch = 0
        self.step = 0  # batches of this epoch already yielded (and so, for a state, trained on)
        self._stream: ShardStream | None = None
        self._loader: CountingLoader | None = None

    # ------------------------------------------------------------------ iterating

    def _built(self) -> CountingLoader:
        """The pipeline for the current partition, made on first use (workers start with it)."""
        if self._loader is None:
            self._stream = ShardStream(
                self.manifest,
                self.data,
                batch_size=self.batch_size,
                rank=self.rank,
                world_size=self.world_size,
                train=self.train,
                seed=self.seed,
                partition=self.partition,
                **self._stream_options,
            )
            self._loader = make_loader(
                self._stream, self.data.num_workers, self.data.prefetch_factor, **self._loader_options
            )
            self._loader.start_workers()
        return self._loader

    def start(self) -> ShardLoader:
        """Make the pipeline and start its workers now (otherwise the first pass does).

        A process that takes stop signals (SIGTERM, Ctrl-C) for a save should start
        them here, on its main thread: they start immune to both (data.read.loader).
        """
        self._built()
        return self

    @property
    def layout(self) -> EpochLayout:
        """The epoch's plan: steps, padded and dropped samples, the global batch."""
        return self._layout()

    @property
    def steps(self) -> int:
        """Batches of a whole epoch, on every rank alike."""
        return self._layout().steps

    def __len__(self) -> int:
        return self.steps

    def _layout(self) -> EpochLayout:
        """The epoch's plan, as the stream makes it."""
        return epoch_layout(self.manifest, self.data, self.batch_size, self.world_size, self.train)

    def set_epoch(self, epoch: int, skip_batches: int | None = None) -> None:
        """The epoch the next pass reads, from its batch skip_batches on.

        Without skip_batches the same epoch again keeps the position within it
        (a state loaded mid-epoch), another one starts at its first batch.
        """
        if epoch < 0:
            raise ConfigError(f"ShardLoader.set_epoch: epoch {epoch} is negative")
        if skip_batches is not None:
            self.epoch, self.step = epoch, skip_batches
        elif epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The rest of the epoch's batches: image uint8 (B, C, H, W); label int64, real bool (B,);
        in the public loader's, sample_id int64 (B,) and key (the samples' __key__, a list); in
        the trainer's, the augmentation's draws."""
        loader = self._built()
        loader.set_epoch(self.epoch, skip_batches=self.step)
        for batch in loader:
            self.step += 1
            yield batch
        # A worker's error is raised above: a pass that ends early is bad data or a lost reader.
        loader.raise_if_incomplete(self.manifest.split)
        self.epoch, self.step = self.epoch + 1, 0

    @property
    def filled(self) -> int:
        """Places of the last pass that bad data left empty (on_error="skip"), filled with padding."""
        return self._loader.filled if self._loader is not None else 0

    @property
    def bad_shards(self) -> list[str]:
        """The last pass's first shards with bad data (a few)."""
        return self._loader.bad_shards if self._loader is not None else []

    @property
    def sample_ids(self) -> list[np.ndarray]:
        """The last pass's real sample ids, a batch each (kept only with of_split's record_ids)."""
        return self._loader.sample_ids if self._loader is not None else []

    @property
    def waits(self) -> BatchWaits | None:
        """The last pass's waits for batches, by whose lateness (observe.timing)."""
        return self._loader.waits if self._loader is not None else None

    def raise_if_incomplete(self, split: str) -> None:
        """A DataError if the last pass yielded fewer batches than planned."""
        self._built().raise_if_incomplete(split)

    def close(self) -> None:
        """Stop the workers (they also stop with this process)."""
        close_shard_loaders(self)

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the position

    def state_dict(self, position: tuple[int, int] | None = None) -> dict[str, Any]:
        """Where the training order stands: small, JSON-serialisable, the same on every rank.

        position: (epoch, step) trained so far, for a consumer that reads ahead
        of its training (tpustream's device loader); default the batches yielded.
        Beside the position, what the order depends on (training.epoch_order's
        keys): a checkpoint's data plan is this state.
        """
        epoch, step = (self.epoch, self.step) if position is None else position
        return {
            "format": STATE_FORMAT,
            "dataset": dataset_fingerprint(self.manifest),
            "samples": self.manifest.num_samples,
            "shards": len(self.manifest.shards),
            "train": self.train,
            "seed": self.seed,
            "global_batch": self.batch_size * self.world_size,
            **(self.partition.as_dict() if self.partition is not None else {}),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_workers": self.data.num_workers,
            "steps_per_epoch": self.steps,
            "epoch": int(epoch),
            "step": int(step),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stood, on this loader's rank and number of ranks.

        The global batch must be the state's (batch_size x world_size): the same
        global batches then follow, whatever the ranks and workers. Another
        dataset, seed or split is refused in one line naming it.
        """
        if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, FIRST_STATE_FORMAT):
            raise ConfigError(f"ShardLoader.load_state_dict: not a ShardLoader state ({STATE_FORMAT})")
        if state["format"] == FIRST_STATE_FORMAT:  # its partition was a dict of its own
            state = {**state, **(state["partition"] or {})}
        mine = self.state_dict()
        refused = "ShardLoader.load_state_dict:"
        if state["dataset"] != mine["dataset"]:
            raise ConfigError(
                f"{refused} the state is of another dataset ({state['samples']} samples in "
                f"{state['shards']} shard(s)); this loader reads {mine['samples']} in {mine['shards']} "
                f"({self.manifest.split})"
            )
        for key, what in (("train", "split kind (train)"), ("seed", "seed")):
            if state[key] != mine[key]:
                raise ConfigError(
                    f"{refused} the state's {what} is {state[key]!r}, this loader's {mine[key]!r}"
                )
        wanted, ranks = state["global_batch"], self.world_size
        if wanted != mine["global_batch"]:
            raise ConfigError(
                f"{refused} the state's global batch is {wanted}, this loader's {self.batch_size} x "
                f"{ranks} rank(s) = {mine['global_batch']}: set batch_size={wanted // ranks}"
                if wanted % ranks == 0
                else f"{refused} the state's global batch {wanted} does not split over {ranks} rank(s)"
            )
        partition = CanonicalPartition.from_dict(state)
        if self.train:
            if partition is None:
                same = (state["world_size"], state["num_workers"]) == (self.world_size, self.data.num_workers)
                if state["step"] and not same:
                    raise ConfigError(
                        f"{refused} a state of streams=0 continues mid-epoch only on its "
                        f"own shape ({state['world_size']} rank(s), {state['num_workers']} worker(s))"
                    )
            else:
                partition.check_shape(self.world_size, self.batch_size, self.data.num_workers)
            if partition != self.partition:
                self.close()  # the pipeline is made again for the state's partition
                self.partition = partition
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def close_shard_loaders(*loaders: ShardLoader) -> None:
    """Stop the workers of every loader, all of them at once (made again if iterated after)."""
    close_loaders(*(loader._loader for loader in loaders if loader._loader is not None))
    for loader in loaders:
        loader._loader = loader._stream = None


# How long a rank other than 0 waits for rank 0's index of shards without a count.
INDEX_WAIT_SECONDS = 3600.0


def resolve_split(shards: str | Sequence[str], split: str, options: SplitOptions, rank: int) -> ShardManifest:
    """The split with every shard's count; rank 0 counts what has no count, the others wait for its index.

    No collective: a loader made on some ranks only (an evaluation on rank 0) waits for nothing.
    """
    options = dataclasses.replace(options, progress=False)
    if rank == 0:
        return load_split(shards, split, options)
    return load_split_counted_elsewhere(shards, split, options, "rank 0", INDEX_WAIT_SECONDS)
