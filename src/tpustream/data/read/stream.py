"""A replica's split as a dataset: the stages composed into a webdataset pipeline per DataLoader worker.

``ShardStream`` plans the replica's share of each epoch (``plan``), chooses
once where samples come from (streamed shards or the split in shared memory),
and builds, in each worker, a ``webdataset.DataPipeline`` of the stages in
``stages`` (and ``user_stages``). ``loader`` wraps it in a DataLoader.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterator

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from tpustream.augment.draws import BatchDraws
from tpustream.config import AugmentConfig, DataConfig, LastBatch, OnError, TrainCrop
from tpustream.data.format.decode import ImageDecoder
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.assemble import BatchSlots, SlotWriter, join_batches, portable, ring_slots
from tpustream.data.read.crop_flip import draw_crop_flip
from tpustream.data.read.encoded import SHARED_FIELDS, stream_crops
from tpustream.data.read.layout import (
    CanonicalPartition,
    EpochLayout,
    SampleSpan,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    stream_spans,
    worker_batches,
)
from tpustream.data.read.memory import SplitMemory
from tpustream.data.read.partition import pieces_hold_whole_groups
from tpustream.data.read.sources import MemorySamples, StreamedSamples
from tpustream.data.read.stages import (
    ErrorPolicy,
    add_device_draws,
    augment_batches,
    batch_samples,
    shuffle_samples,
    skip_samples,
)
from tpustream.data.read.user_stages import apply_user_stages
from tpustream.observe.timing import stamp_made

# Keeps the canonical streams' generators apart from the per-reader plan's.
STREAM_SALT = 0x5354524D  # "STRM"


def epoch_layout(
    manifest: ShardManifest, data: DataConfig, batch_size: int, world_size: int, train: bool
) -> EpochLayout:
    """A split's epoch plan for this many replicas of batch_size: training's by data.last_batch."""
    # Validation always pads and masks so it covers every sample once.
    last_batch = LastBatch(data.last_batch) if train else LastBatch.pad
    return plan_layout(manifest.num_samples, batch_size, world_size, last_batch, manifest.split)


class ShardStream(IterableDataset):
    """One replica's batches of one split, for a DataLoader with batch_size=None.

    Each batch is {"image": uint8 (B, C, H, W), "label": int64 (B,), "real":
    bool (B,) True for samples that count in loss and metrics, "filled": the
    real samples bad data took out, never padding}.

    in_memory=True reads and decodes the whole split once, at construction,
    into shared memory, and serves the same batches from there.

    partition (training): the run's canonical streams (plan.CanonicalPartition).
    Each DataLoader worker then yields, for every step, a piece of the batch
    (the chunks of the streams it reads, in order): the loader receives the
    workers' pieces round-robin and ``join`` makes them the batch.

    train_crop=random_resized crops images of any size to the manifest's
    (square) image size: random-resized crops and flips for training, drawn
    per (seed, epoch, sample), the evaluation centre crop otherwise.
    """

    def __init__(
        self,
        manifest: ShardManifest,
        data: DataConfig,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        train: bool,
        seed: int,
        augment: AugmentConfig | None = None,
        augment_group: int = 0,
        partition: CanonicalPartition | None = None,
    ):
        """The run's data.* section whole; the rest says which replica, split and batch this is.

        augment (training): the device's augmentation, whose draws each batch
        carries (augment.draws); augment_group: one device's batch within this
        one (its pairs and batch-level draws stay inside it; default: all of it).
        """
        super().__init__()
        self.manifest = manifest
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = data.num_workers
        self.train = train
        self.seed = seed
        self.shuffle_buffer = data.shuffle_buffer if train else 0
        self.on_error = OnError(data.on_error)
        self.stages = list(data.stages)
        self.train_crop = TrainCrop(data.train_crop)
        self.crop_padding = data.crop_padding
        self.hflip = data.hflip
        if manifest.image_size is None:
            raise ValueError(f"{manifest.split}: images of varying size need train_crop=random_resized")
        height, width = manifest.image_size
        self.decoder = ImageDecoder(
            manifest.channels,
            height,
            width,
            manifest.num_classes,
            image_key=data.image_key,
            label_key=data.label_key,
        )
        # Random-resized crops (None: pad_crop); with data.decode=device the workers send
        # JPEGs and crops (data.read.encoded), and a batch with no sample is blanks.
        self.crops, self.blank = stream_crops(self.decoder, data, train, seed)
        self.group = augment_group or batch_size  # one device's batch
        self.draws: BatchDraws | None = None
        if train and augment is not None and augment.active():
            channels, out_height, out_width = self.decoder.shape
            self.draws = BatchDraws(augment, (out_height, out_width), channels, self.group, seed)
        self.layout: EpochLayout = epoch_layout(manifest, data, batch_size, world_size, train)
        self.partition = partition if train else None
        if self.partition is not None:
            self.partition.check_shape(world_size, batch_size, self.num_workers)
        # Fixed for the run: asked for every batch.
        self.pieces_draw = self.partition is None or pieces_hold_whole_groups(
            self.partition, world_size, self.pieces_per_batch, self.layout.global_batch_size, self.group
        )
        # Loaded here, in the replica's main process, not on first iteration:
        # with DataLoader workers __iter__ only ever runs in the workers, which
        # receive this object by pickling when the loader first iterates. Loaded
        # before that, it reaches them as handles to the one shared copy rather
        # than being read by each worker. A bad split under on_error=raise then
        # also stops the run at start-up, before any step is compiled.
        self.samples: StreamedSamples | MemorySamples = (
            MemorySamples(manifest, self.decoder, self.on_error)
            if data.in_memory
            else StreamedSamples(manifest)
        )
        # The ring of batches DataLoader workers write into (data.read.assemble),
        # made here so that the workers receive it as shared memory.
        ring = ring_slots(data.prefetch_factor, self.num_workers, self.partition is not None)
        self.slots = (
            BatchSlots(ring, batch_size, self.decoder.shape)
            if self.num_workers > 0 and not self.encoded
            else None
        )
        # Shared with persistent DataLoader workers, which hold their own
        # copy of this object: they read the epoch when each epoch starts.
        self._epoch = multiprocessing.RawValue("q", 0)
        self._skip = multiprocessing.RawValue("q", 0)

    @property
    def encoded(self) -> bool:
        """Whether batches carry encoded images for the device to decode (data.decode=device)."""
        return self.blank is not None

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch's shard order and random streams (before iterating)."""
        self._epoch.value = epoch
        # Resuming mid-epoch: the first skip_batches batches of this epoch were
        # trained on before the checkpoint; yield exactly the ones after them.
        self._skip.value = skip_batches

    def worker_role(self, worker: int, workers: int) -> tuple[int, int]:
        """(the worker of the uninterrupted epoch this worker stands for, its batches to skip).

        The DataLoader takes batches from its workers round-robin, starting
        at worker 0, and the workers' counts differ by at most one (extra ones
        go to the lowest workers), so batch b of an epoch comes from worker
        b % workers. A pass resumed after `skip` batches starts at batch skip,
        so DataLoader worker i plays worker (i + skip) % workers, which skips
        the ones of its batches that came before.
        """
        skip = self._skip.value
        if self.partition is not None:
            return worker, skip  # every worker gives a piece of every batch
        role = (worker + skip) % workers
        return role, max(0, -(-(skip - role) // workers))

    def __len__(self) -> int:
        """Items the loader yields in the current pass (an epoch, or what is left of it when resuming)."""
        return (self.layout.steps - self._skip.value) * self.pieces_per_batch

    @property
    def pieces_per_batch(self) -> int:
        """Items of the loader that make one batch: one per worker under a canonical partition."""
        return max(self.num_workers, 1) if self.partition is not None else 1

    def join(self, pieces: list[dict]) -> dict:
        """One batch from its pieces, in worker order; with the device's draws unless workers added them."""
        return self.complete(join_batches(pieces))

    def complete(self, batch: dict) -> dict:
        """A batch joined from workers' pieces (here or in data.read.assemble), with the draws they lack."""
        return batch if self.pieces_draw else self._with_draws(batch)

    def _with_draws(self, batch: dict) -> dict:
        if self.draws is not None:  # the device augmentation's draws for the batch's samples
            batch.update(self.draws(self.epoch, np.asarray(batch["sample_id"])))
        return batch

    def worker_spans(self, worker: int, workers: int) -> list[SampleSpan]:
        shards = order_shards(self.manifest.shards, self.seed, self.epoch, shuffle=self.train)
        replica = split_by_replica(shards, self.layout, self.rank)
        return split_by_worker(replica, self.batch_size, worker, workers)

    def _rng(self, worker: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, self.rank, worker, stream])

    def _stream_rng(self, stream: int, use: int) -> np.random.Generator:
        """A canonical stream's generator: the same whichever replica and worker read the stream."""
        return np.random.default_rng([self.seed, self.epoch, STREAM_SALT, stream, use])

    @property
    def memory(self) -> SplitMemory | None:
        """The split in shared memory (data.in_memory), else None."""
        return self.samples.memory if isinstance(self.samples, MemorySamples) else None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        worker, skip = self.worker_role(worker, workers)
        # In a DataLoader worker, images go into the replica's shared slots.
        generation = self.slots.generation if info is not None and self.slots is not None else None
        if self.partition is not None:
            items = self.pieces(worker, workers, skip, generation)
        else:
            items = iter(
                self.pipeline(worker, workers, skip, self._reader_writer(worker, workers, skip, generation))
            )
        if info is not None:  # a worker's piece travels inside its message, numpy arrays pickled inline
            items = map(functools.partial(portable, shared=SHARED_FIELDS), items)
        return map(stamp_made, items)

    def _reader_writer(
        self, role: int, workers: int, skipped: int, generation: int | None
    ) -> SlotWriter | None:
        """A per-reader worker's place in the pass's batches (after its `skipped` ones: worker_role).

        Its epoch batches are role, role + workers, ...; the pass numbers from epoch batch self._skip.
        """
        if generation is None or self.slots is None:
            return None
        first = role + skipped * workers - self._skip.value
        return SlotWriter(self.slots, generation, first, workers, 0, self.batch_size)

    def pieces(
        self, worker: int, workers: int, skip: int, generation: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """This worker's piece of every batch from batch skip on: its streams' chunks, joined in order.

        With a generation (in a DataLoader worker), each chunk goes to its place in the batch's slot.
        """
        assert self.partition is not None
        streams = self.partition.streams_of(self.rank, self.world_size, worker, workers)
        chunk = self.partition.stream_batch(self.layout.global_batch_size)
        own = self.rank * self.partition.per_replica(self.world_size)  # the replica's first stream
        writers = [
            (
                SlotWriter(self.slots, generation, 0, 1, (stream - own) * chunk, chunk)
                if generation is not None and self.slots is not None
                else None
            )
            for stream in streams
        ]
        chunks = [
            iter(self.stream_pipeline(stream, skip, writer))
            for stream, writer in zip(streams, writers, strict=True)
        ]
        for parts in zip(*chunks, strict=True):  # every stream gives steps - skip chunks
            joined = join_batches(list(parts))
            yield self._with_draws(joined) if self.pieces_draw else joined

    def stream_pipeline(self, stream: int, skip: int, writer: SlotWriter | None = None) -> wds.DataPipeline:
        """One canonical stream's chunks (global_batch / C samples a step) from step skip on.

        Its shuffle, its bad-data fills and its pad-crop draws are its own, so
        they are the same whoever reads it.
        """
        assert self.partition is not None
        on_error = ErrorPolicy(self.on_error)
        chunk = self.partition.stream_batch(self.layout.global_batch_size)
        shards = order_shards(self.manifest.shards, self.seed, self.epoch, shuffle=True)
        spans = stream_spans(shards, self.layout, self.partition, stream)
        augment_rng = self._stream_rng(stream, 2) if self.crops is None else None
        if augment_rng is not None:
            for _ in range(skip):
                draw_crop_flip(augment_rng, chunk, self.crop_padding, self.hflip)
        return wds.DataPipeline(
            [spans],
            self.samples.read(on_error),
            functools.partial(
                shuffle_samples, buffer_size=self.partition.stream_buffer, rng=self._stream_rng(stream, 1)
            ),
            functools.partial(skip_samples, count=skip * chunk, on_error=on_error),
            *self.sample_stages(on_error),
            *self.batch_stages(on_error, chunk, self.layout.steps - skip, augment_rng, writer),
        )

    def sample_stages(self, on_error: ErrorPolicy) -> list[Callable | None]:
        """Decoding, then the user's stages (None where there are none)."""
        return [
            self.samples.decode(
                on_error, self.crops.for_epoch(self.epoch) if self.crops is not None else self.decoder
            ),
            (
                functools.partial(
                    apply_user_stages,
                    paths=self.stages,
                    shape=self.decoder.shape,
                    num_classes=self.decoder.num_classes,
                    shard_urls=[shard.url for shard in self.manifest.shards],
                    on_error=on_error,
                )
                if self.stages
                else None
            ),
        ]

    def batch_stages(
        self,
        on_error: ErrorPolicy,
        batch_size: int,
        batches: int,
        augment_rng: np.random.Generator | None,
        writer: SlotWriter | None = None,
    ) -> list[Callable]:
        """Exactly `batches` batches of batch_size, pad-cropped and flipped when augment_rng is given.

        With a writer their images are written into the shared slots.
        """
        return [
            functools.partial(
                batch_samples,
                batch_size=batch_size,
                num_batches=batches,
                shape=self.decoder.shape,
                on_error=on_error,
                writer=writer if augment_rng is None else None,  # else augment_batches writes
                blank=self.blank,
            ),
            functools.partial(
                augment_batches,
                rng=augment_rng,
                crop_padding=self.crop_padding,
                hflip=self.hflip,
                on_error=on_error,
                writer=writer,
            ),
        ]

    def pipeline(
        self, worker: int, workers: int, skip: int, writer: SlotWriter | None = None
    ) -> wds.DataPipeline:
        """This worker's stages for the current epoch, as one webdataset pipeline."""
        on_error = ErrorPolicy(self.on_error)
        spans = self.worker_spans(worker, workers)
        batches = worker_batches(self.layout.steps, worker, workers) - skip
        # Random-resized crops and their flips are drawn per sample while
        # decoding; the batch-level pad-crop draws from this worker's stream.
        augment_rng = self._rng(worker, 2) if self.train and self.crops is None else None
        if augment_rng is not None:
            # Advance past the skipped batches' draws, as augmenting them would have.
            for _ in range(skip):
                draw_crop_flip(augment_rng, self.batch_size, self.crop_padding, self.hflip)
        return wds.DataPipeline(
            # The source: this worker's part of the epoch plan. Wrapped, because
            # DataPipeline splices a list argument into its stages.
            [spans],
            self.samples.read(on_error),
            (
                functools.partial(shuffle_samples, buffer_size=self.shuffle_buffer, rng=self._rng(worker, 1))
                if self.train
                else None
            ),
            functools.partial(skip_samples, count=skip * self.batch_size, on_error=on_error),
            *self.sample_stages(on_error),
            *self.batch_stages(on_error, self.batch_size, batches, augment_rng, writer),
            functools.partial(add_device_draws, draws=self.draws, epoch=self.epoch) if self.draws else None,
        )
