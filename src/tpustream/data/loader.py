"""A replica's loader: the stages composed into a webdataset pipeline per DataLoader worker.

``ShardStream`` plans the replica's share of each epoch (``sharding``),
chooses once where samples come from (streamed shards or the split in shared
memory), and builds, in each worker, a ``webdataset.DataPipeline`` of the
stages in ``stages``. ``CountingLoader`` keeps host-only fields off the
device and checks that every planned batch arrived.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tpustream.config import DataConfig, LastBatch, OnError, TrainCrop
from tpustream.data.augment import draw_crop_flip
from tpustream.data.crops import CroppingDecoder
from tpustream.data.decode import ImageDecoder
from tpustream.data.manifest import ShardManifest
from tpustream.data.memory import SplitMemory, load_split_memory, read_memory_samples, take_memory_samples
from tpustream.data.sharding import (
    EpochLayout,
    SampleSpan,
    order_shards,
    plan_layout,
    split_by_replica,
    split_by_worker,
    worker_batches,
)
from tpustream.data.stages import (
    ErrorPolicy,
    apply_user_stages,
    augment_batches,
    batch_samples,
    decode_samples,
    read_span_samples,
    shuffle_samples,
    skip_samples,
)
from tpustream.errors import DataError, TpustreamError
from tpustream.preemption import stop_signals_ignored

SampleDecoder = Callable[[dict], tuple[np.ndarray, int]]


class StreamedSamples:
    """Samples read from the shards and decoded in the worker, every epoch."""

    def __init__(self, manifest: ShardManifest):
        self.shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
        self.shard_counts = [shard.samples for shard in manifest.shards]

    def read(self, on_error: ErrorPolicy) -> Callable[[Iterable[SampleSpan]], Iterator]:
        return functools.partial(
            read_span_samples, on_error=on_error, shard_index=self.shard_index, shard_counts=self.shard_counts
        )

    def decode(self, on_error: ErrorPolicy, decoder: SampleDecoder) -> Callable[[Iterable], Iterator]:
        return functools.partial(decode_samples, decoder=decoder, on_error=on_error)


class MemorySamples:
    """Samples looked up in the split decoded once into shared memory.

    Bad samples were reported when the split was loaded, not again here
    (but counted, every pass).
    """

    def __init__(self, manifest: ShardManifest, decoder: ImageDecoder, on_error: OnError):
        self.shard_index = {shard.url: i for i, shard in enumerate(manifest.shards)}
        self.memory: SplitMemory = load_split_memory(manifest, decoder, ErrorPolicy(on_error))

    def read(self, on_error: ErrorPolicy) -> Callable[[Iterable[SampleSpan]], Iterator]:
        return functools.partial(
            read_memory_samples, memory=self.memory, shard_index=self.shard_index, on_error=on_error
        )

    def decode(self, on_error: ErrorPolicy, decoder: SampleDecoder) -> Callable[[Iterable], Iterator]:
        return functools.partial(take_memory_samples, memory=self.memory, on_error=on_error)


# ShardStream's keyword arguments that are data.* config fields of the same name.
STREAM_OPTIONS = (
    "num_workers",
    "shuffle_buffer",
    "last_batch",
    "on_error",
    "train_crop",
    "crop_padding",
    "eval_crop_ratio",
    "hflip",
    "in_memory",
    "image_key",
    "label_key",
    "stages",
)


class ShardStream(IterableDataset):
    """One replica's batches of one split, for a DataLoader with batch_size=None.

    Each batch is {"image": uint8 (B, C, H, W), "label": int64 (B,), "real":
    float32 (B,) 1 for samples that count in loss and metrics, "filled": the
    real samples bad data took out, never padding}.

    in_memory=True reads and decodes the whole split once, at construction,
    into shared memory, and serves the same batches from there.

    train_crop=random_resized crops images of any size to the manifest's
    (square) image size: random-resized crops and flips for training, drawn
    per (seed, epoch, sample), the evaluation centre crop otherwise.
    """

    def __init__(
        self,
        manifest: ShardManifest,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        train: bool,
        seed: int,
        shuffle_buffer: int = 0,
        last_batch: LastBatch | str = LastBatch.pad,
        on_error: OnError | str = OnError.skip,
        train_crop: TrainCrop | str = TrainCrop.pad_crop,
        crop_padding: int = 4,
        eval_crop_ratio: float = 0.875,
        hflip: bool = True,
        in_memory: bool = False,
        image_key: str | None = None,
        label_key: str = "cls",
        stages: Sequence[str] = (),
    ):
        super().__init__()
        self.manifest = manifest
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.train = train
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer if train else 0
        self.on_error = OnError(on_error)
        self.stages = list(stages)
        self.train_crop = TrainCrop(train_crop)
        self.crop_padding = crop_padding
        self.hflip = hflip
        if manifest.image_size is None:
            raise ValueError(f"{manifest.split}: images of varying size need train_crop=random_resized")
        height, width = manifest.image_size
        self.decoder = ImageDecoder(
            manifest.channels, height, width, manifest.num_classes, image_key=image_key, label_key=label_key
        )
        self.crops: CroppingDecoder | None = None
        if self.train_crop == TrainCrop.random_resized:
            if in_memory:
                raise ValueError("in_memory holds decoded images; random_resized crops need the encoded ones")
            self.crops = CroppingDecoder(self.decoder, train, seed, eval_crop_ratio, hflip)
        # Validation always pads and masks so it covers every sample once.
        self.layout: EpochLayout = plan_layout(
            manifest.num_samples,
            batch_size,
            world_size,
            last_batch if train else LastBatch.pad,
            manifest.split,
        )
        # Loaded here, in the replica's main process, not on first iteration:
        # with DataLoader workers __iter__ only ever runs in the workers, which
        # receive this object by pickling when the loader first iterates. Loaded
        # before that, it reaches them as handles to the one shared copy rather
        # than being read by each worker. A bad split under on_error=raise then
        # also stops the run at start-up, before any step is compiled.
        self.samples: StreamedSamples | MemorySamples = (
            MemorySamples(manifest, self.decoder, self.on_error) if in_memory else StreamedSamples(manifest)
        )
        # Shared with persistent DataLoader workers, which hold their own
        # copy of this object: they read the epoch when each epoch starts.
        self._epoch = multiprocessing.RawValue("q", 0)
        self._skip = multiprocessing.RawValue("q", 0)

    @classmethod
    def from_config(
        cls,
        manifest: ShardManifest,
        data: DataConfig,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        train: bool,
        seed: int,
    ) -> ShardStream:
        """The stream a replica trains or evaluates on, with every data.* option of the run's config."""
        return cls(
            manifest,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            train=train,
            seed=seed,
            **{name: getattr(data, name) for name in STREAM_OPTIONS},
        )

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
        role = (worker + skip) % workers
        return role, max(0, -(-(skip - role) // workers))

    def __len__(self) -> int:
        """Batches of the current pass (an epoch, or what is left of it when resuming)."""
        return self.layout.steps - self._skip.value

    def worker_spans(self, worker: int, workers: int) -> list[SampleSpan]:
        shards = order_shards(self.manifest.shards, self.seed, self.epoch, shuffle=self.train)
        replica = split_by_replica(shards, self.layout, self.rank)
        return split_by_worker(replica, self.batch_size, worker, workers)

    def _rng(self, worker: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch, self.rank, worker, stream])

    @property
    def memory(self) -> SplitMemory | None:
        """The split in shared memory (data.in_memory), else None."""
        return self.samples.memory if isinstance(self.samples, MemorySamples) else None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        worker, skip = self.worker_role(worker, workers)
        return iter(self.pipeline(worker, workers, skip))

    def pipeline(self, worker: int, workers: int, skip: int) -> wds.DataPipeline:
        """This worker's stages for the current epoch, as one webdataset pipeline."""
        on_error = ErrorPolicy(self.on_error)
        spans = self.worker_spans(worker, workers)
        # Random-resized crops and their flips are drawn per sample while
        # decoding; the batch-level pad-crop draws from this worker's stream.
        augment_rng = self._rng(worker, 2) if self.train and self.crops is None else None
        if augment_rng is not None:
            # Advance past the skipped batches' draws, as augmenting them would have.
            for _ in range(skip):
                draw_crop_flip(augment_rng, self.batch_size, self.crop_padding, self.hflip)
        shape = self.decoder.shape
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
            self.samples.decode(
                on_error, self.crops.for_epoch(self.epoch) if self.crops is not None else self.decoder
            ),
            (
                functools.partial(
                    apply_user_stages,
                    paths=self.stages,
                    shape=shape,
                    num_classes=self.decoder.num_classes,
                    shard_urls=[shard.url for shard in self.manifest.shards],
                    on_error=on_error,
                )
                if self.stages
                else None
            ),
            functools.partial(
                batch_samples,
                batch_size=self.batch_size,
                num_batches=worker_batches(self.layout.steps, worker, workers) - skip,
                shape=shape,
                on_error=on_error,
            ),
            functools.partial(
                augment_batches,
                rng=augment_rng,
                crop_padding=self.crop_padding,
                hflip=self.hflip,
                on_error=on_error,
            ),
        )


# Shards with bad data each replica remembers per pass, for the error that names them.
MAX_BAD_SHARDS = 3


class CountingLoader:
    """Iterates a DataLoader, taking the host-only fields out of each batch.

    'filled' is summed per epoch; 'sample_id' is kept (for the real samples)
    when record_ids is set, for exactness audits. A worker's exception comes
    out as our own one-line error (DataLoader wraps it in a "Caught X in
    DataLoader worker" text with the worker traceback). The trainer calls
    ``raise_if_incomplete`` after each loop as a last line of defence: a
    replica that ran fewer steps than planned would leave the others waiting
    in an all-reduce.

    It is the trainer's ``training.source.EpochSource``.
    """

    def __init__(self, loader: DataLoader, record_ids: bool = False):
        self.loader = loader
        self.record_ids = record_ids
        self.filled = 0
        self.batches = 0
        self.sample_ids: list[np.ndarray] = []
        self.bad_shards: list[str] = []  # this pass's shards with bad data, first MAX_BAD_SHARDS

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def steps(self) -> int:
        """Batches of a whole epoch (the layout's, whatever this pass skips)."""
        return self.loader.dataset.layout.steps

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch the next pass yields, from its batch skip_batches on (see ShardStream)."""
        self.loader.dataset.set_epoch(epoch, skip_batches=skip_batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.filled = self.batches = 0
        self.sample_ids = []
        self.bad_shards = []
        try:
            for batch in self.loader:
                self.filled += int(batch.pop("filled"))
                for url in batch.pop("bad_shards", ()):
                    if len(self.bad_shards) < MAX_BAD_SHARDS and url not in self.bad_shards:
                        self.bad_shards.append(url)
                ids = batch.pop("sample_id")
                if self.record_ids:
                    self.sample_ids.append(ids[batch["real"] > 0].numpy())
                self.batches += 1
                yield batch
        except TpustreamError as exc:
            raise _unwrap_worker_error(exc) from exc

    def start_workers(self) -> None:
        """Start the persistent DataLoader workers now, immune to stop signals from their first moment.

        Called on the replica's main thread at set-up (not on first iteration,
        which happens on MpDeviceLoader's thread, where signal dispositions
        cannot be changed). The workers then begin the current pass; the first
        real iteration resets them to the epoch set by then (DataLoader's
        persistent-worker reset), so batches are the same.
        """
        if (
            self.loader.num_workers == 0
            or not self.loader.persistent_workers
            or self.loader._iterator is not None
        ):
            return
        with stop_signals_ignored():
            self.loader._iterator = self.loader._get_iterator()

    def close(self) -> None:
        """Stop the DataLoader's persistent workers now.

        They ignore SIGTERM (a preempted replica must outlive the signal), so
        they must not be left to multiprocessing's exit handler, which
        terminates daemon children with SIGTERM and then joins them forever.
        DataLoader has no public close; its iterator's shutdown tells the
        workers to leave their loop, joins them, and kills stragglers.
        """
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None

    def raise_if_incomplete(self, split: str) -> None:
        if self.batches != len(self):
            raise DataError(f"{split} loader yielded {self.batches} of {len(self)} planned batches")


def _unwrap_worker_error(exc: TpustreamError) -> TpustreamError:
    """Our one-line error back out of DataLoader's "Caught X in DataLoader worker" text."""
    if exc.args and "Original Traceback" in str(exc.args[0]):
        last = str(exc.args[0]).strip().splitlines()[-1]
        prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
        return type(exc)(last.removeprefix(prefix))
    return exc


def make_loader(
    stream: ShardStream,
    num_workers: int,
    prefetch_factor: int = 4,
    worker_init_fn: Callable[[int], None] | None = None,
    record_ids: bool = False,
) -> CountingLoader:
    """A DataLoader over a ShardStream (its num_workers must match the stream's plan)."""
    if num_workers != stream.num_workers:
        raise ValueError("the stream was planned for a different number of workers")
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        # Workers start once per run, not per epoch: in an xmp.spawn replica
        # the start method is "spawn", and each new worker imports torch (~3 s).
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init_fn,
    )
    return CountingLoader(loader, record_ids)
