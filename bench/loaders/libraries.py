"""bench.loaders' readers: one small class per library, each one rank's loader read a batch at a time.

Every reader is built for a Place (rank, world size, this rank's batch,
workers, seed), started from nothing or from a state its own library handed
out, and yields per batch the number of images (uint8, 3 x 224 x 224, the
shape checked) and the image indices of the real samples in it. tpustream
crops with its own pipeline (ShardLoader, crop="random_resized"); the others
with the stock one: PIL decode, then torchvision.transforms.v2
RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, in their
workers. Each is used the way its documentation shows:

    tpustream   ShardLoader over the tar shards; state_dict / load_state_dict.
    webdataset  WebDataset(shardshuffle=100, nodesplitter=this rank's shards)
                .shuffle(1000) .to_tuple("jpg", "__key__") .map_tuple(the
                stock crop, int) .batched(B) in WebLoader workers, as
                bench.feed.stock (which decodes with .decode("pil")); no
                state: a resume reads and drops the batches trained on.
    mosaic      StreamingDataset over the MDS copy (its __getitem__ decodes and
                crops), StreamingDataLoader's state_dict / load_state_dict;
                rank and world from RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, so each
                rank is its own process (its workers meet at shared-memory
                barriers).
    torchdata   StatefulDataLoader over a map-style dataset of the JPEG files,
                with torchdata's StatefulDistributedSampler(num_replicas, rank).
    grain       grain.python DataLoader over a data source of the JPEG files,
                IndexSampler(shard_options=ShardOptions(rank, world)), its
                iterator's get_state / set_state.
"""

from __future__ import annotations

import functools
import gc
import importlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torchvision.transforms import v2

from bench.loaders.data import LoaderData
from tpustream.data import ShardLoader
from tpustream.data.read.stages import SHARD_ID_SHIFT

IMAGE_SIZE = 224
# bench.feed.stock's: WebDataset(shardshuffle=...) and .shuffle(...).
SHARD_SHUFFLE = 100
SHUFFLE_BUFFER = 1000


@dataclass(frozen=True)
class Place:
    """Where a loader reads: its rank of world ranks, its own batch, its workers, the seed."""

    rank: int
    world: int
    batch_size: int
    workers: int
    seed: int = 0


class DecodeCrop:
    """JPEG bytes to a uint8 (3, 224, 224) tensor, the stock way: PIL, then torchvision's v2 crops."""

    def __init__(self, size: int = IMAGE_SIZE):
        self.transform = v2.Compose([v2.RandomResizedCrop(size), v2.RandomHorizontalFlip(), v2.PILToTensor()])

    def __call__(self, jpeg: bytes) -> torch.Tensor:
        return self.transform(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def counted(images: torch.Tensor | np.ndarray) -> int:
    """The batch's image count, after checking it is what every row must yield (uint8 N x 3 x 224 x 224)."""
    shape, dtype = tuple(images.shape), images.dtype
    if shape[1:] != (3, IMAGE_SIZE, IMAGE_SIZE) or dtype not in (torch.uint8, np.uint8):
        raise AssertionError(f"a batch of {dtype} {shape}, expected uint8 (N, 3, {IMAGE_SIZE}, {IMAGE_SIZE})")
    return shape[0]


class Reader:
    """One rank's loader of one library: start (from a state or not), then next_batch until the epoch ends."""

    name = ""
    modules: tuple[str, ...] = ()  # what must import for the row to run (the optional libraries)
    # Whether the library has a state of its own (webdataset has none).
    has_state = True
    # Whether each rank must be a process of its own, all ranks at once (see MosaicReader).
    own_process = False

    def __init__(self, data: LoaderData, place: Place):
        self.data, self.place = data, place
        self.batches: Iterator[Any] | None = None

    def start(self, state: Any = None) -> None:
        """Make the iterator, continuing from `state` (one this library's reader gave) if there is one."""
        raise NotImplementedError

    def next_batch(self) -> tuple[int, np.ndarray]:
        """(images in the next batch, the image indices of its real samples); StopIteration at the end."""
        raise NotImplementedError

    def state(self) -> Any:
        """The library's own state after the batches read so far."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the workers before the next measurement starts its own."""
        self.batches = None
        gc.collect()

    @classmethod
    def missing(cls) -> str | None:
        """None when the library imports, else what is missing (the row then says "not installed")."""
        for module in cls.modules:
            try:
                importlib.import_module(module)
            except ImportError as error:
                return f"{module} not installed ({error})"
        return None

    @classmethod
    def clean_up(cls) -> None:
        """What processes of this library that ended may have left for the next ones to find."""

    @classmethod
    def prepare(cls) -> None:
        """Import what the reader uses before any clock starts: imports cost every library the same."""
        for module in cls.modules:
            importlib.import_module(module)
        DecodeCrop()


class StatefulLoaderReader(Reader):
    """A reader over a loader with torch's state_dict / load_state_dict (tpustream's ShardLoader,
    Mosaic's StreamingDataLoader, torchdata's StatefulDataLoader); batches {"image", "index"}
    unless a subclass reads its own."""

    loader: Any  # set by the subclass's __init__

    def start(self, state: Any = None) -> None:
        if state is not None:
            self.loader.load_state_dict(state)
        self.batches = iter(self.loader)

    def next_batch(self) -> tuple[int, np.ndarray]:
        batch = next(self.batches)
        return counted(batch["image"]), batch["index"].numpy()

    def state(self) -> Any:
        return self.loader.state_dict()


class TpustreamReader(StatefulLoaderReader):
    name = "tpustream"

    def __init__(self, data: LoaderData, place: Place):
        super().__init__(data, place)
        self.loader = ShardLoader(
            str(data.shards),
            batch_size=place.batch_size,
            image_size=IMAGE_SIZE,
            crop="random_resized",
            train=True,
            rank=place.rank,
            world_size=place.world,
            num_workers=place.workers,
            seed=place.seed,
        )

    def next_batch(self) -> tuple[int, np.ndarray]:
        batch = next(self.batches)
        ids = batch["sample_id"][batch["real"]].numpy()
        shard, place = ids >> SHARD_ID_SHIFT, ids & ((1 << SHARD_ID_SHIFT) - 1)
        return counted(batch["image"]), shard * self.data.spec.samples_per_shard + place

    def close(self) -> None:
        self.loader.close()
        super().close()


def shards_of_rank(urls: list[str], rank: int, world: int) -> list[str]:
    """webdataset's split_by_node, with the rank given instead of read from torch.distributed."""
    return list(urls)[rank::world]


class WebLoaderReader(Reader):
    name = "webdataset"
    has_state = False  # a resume reads and drops the batches already trained on

    def __init__(self, data: LoaderData, place: Place):
        super().__init__(data, place)
        dataset = (
            wds.WebDataset(
                data.shard_urls(),
                shardshuffle=SHARD_SHUFFLE,
                seed=place.seed,
                nodesplitter=functools.partial(shards_of_rank, rank=place.rank, world=place.world),
            )
            .shuffle(SHUFFLE_BUFFER, seed=place.seed)
            .to_tuple("jpg", "__key__")
            .map_tuple(DecodeCrop(), int)
            .batched(place.batch_size, partial=True)
        )
        self.loader = wds.WebLoader(dataset, batch_size=None, num_workers=place.workers)
        self.step = 0

    def start(self, state: Any = None) -> None:
        self.batches = iter(self.loader)
        for _ in range(state["step"] if state else 0):
            self.next_batch()

    def next_batch(self) -> tuple[int, np.ndarray]:
        images, keys = next(self.batches)
        self.step += 1
        return counted(images), np.asarray(keys, dtype=np.int64)

    def state(self) -> Any:
        return {"step": self.step}  # what a loop keeps for a loader without a state of its own


@functools.cache
def mosaic_dataset_class() -> type:
    """StreamingDataset whose samples are decoded and cropped (its documented way: override __getitem__)."""
    from streaming import StreamingDataset

    class CroppedImages(StreamingDataset):
        def __init__(self, **options: Any):
            super().__init__(**options)
            self.crop = DecodeCrop()

        def __getitem__(self, index: int) -> dict[str, Any]:
            sample = super().__getitem__(index)
            return {"image": self.crop(sample["jpg"]), "index": int(sample["index"])}

    return CroppedImages


class MosaicReader(StatefulLoaderReader):
    """Mosaic streaming reads rank and world from the environment and its workers of all ranks on a
    node meet at shared-memory barriers: a rank is a process of its own, started with RANK,
    WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE set (bench.loaders.task), all ranks at once."""

    name = "mosaic"
    modules = ("streaming",)
    own_process = True

    def __init__(self, data: LoaderData, place: Place):
        super().__init__(data, place)
        from streaming import StreamingDataLoader

        self.dataset = mosaic_dataset_class()(
            local=str(data.mds),
            shuffle=True,
            shuffle_seed=place.seed,
            batch_size=place.batch_size,
        )
        self.loader = StreamingDataLoader(
            self.dataset, batch_size=place.batch_size, num_workers=place.workers
        )

    def close(self) -> None:
        self.loader = self.dataset = None
        super().close()

    @classmethod
    def clean_up(cls) -> None:
        """Shared memory of ended processes, which a new dataset over the same folder would attach to.

        clean_stale_shared_memory clears every StreamingDataset's on this machine: none other may run.
        """
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


class JpegFiles(torch.utils.data.Dataset):
    """The JPEG files as a map-style dataset: index -> {"image": the stock crop, "index": index}."""

    def __init__(self, data: LoaderData):
        self.data, self.crop = data, DecodeCrop()

    def __len__(self) -> int:
        return self.data.spec.images

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.crop(self.data.jpeg_path(index).read_bytes()), "index": index}


class TorchdataReader(StatefulLoaderReader):
    name = "torchdata"
    modules = ("torchdata.stateful_dataloader", "torchdata.stateful_dataloader.sampler")

    def __init__(self, data: LoaderData, place: Place):
        super().__init__(data, place)
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        dataset = JpegFiles(data)
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=place.world, rank=place.rank, shuffle=True, seed=place.seed
        )
        self.loader = StatefulDataLoader(
            dataset, batch_size=place.batch_size, sampler=sampler, num_workers=place.workers
        )


class JpegFileSource:
    """The JPEG files as a Grain data source: index -> (index, bytes).

    Its repr names the folder: Grain checks a state against repr(data_source),
    and object's default repr (an address) differs in every process.
    """

    def __init__(self, data: LoaderData):
        self.data = data

    def __len__(self) -> int:
        return self.data.spec.images

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        return int(index), self.data.jpeg_path(int(index)).read_bytes()

    def __repr__(self) -> str:
        return f"JpegFileSource({self.data.files}, {len(self)} images)"


@functools.cache
def grain_crop_class() -> type:
    """A grain MapTransform applying the stock crop (Grain's workers get it by cloudpickle)."""
    import grain.python as grain

    class CropJpeg(grain.MapTransform):
        def __init__(self):
            self.crop = DecodeCrop()

        def map(self, element: tuple[int, bytes]) -> dict[str, np.ndarray]:
            index, jpeg = element
            return {"image": self.crop(jpeg).numpy(), "index": np.int64(index)}

    return CropJpeg


class GrainReader(Reader):
    name = "grain"
    modules = ("grain.python",)

    def __init__(self, data: LoaderData, place: Place):
        super().__init__(data, place)
        import grain.python as grain

        source = JpegFileSource(data)
        sampler = grain.IndexSampler(
            num_records=len(source),
            shard_options=grain.ShardOptions(
                shard_index=place.rank, shard_count=place.world, drop_remainder=True
            ),
            shuffle=True,
            num_epochs=1,
            seed=place.seed,
        )
        self.loader = grain.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=[grain_crop_class()(), grain.Batch(place.batch_size, drop_remainder=False)],
            worker_count=place.workers,
        )

    def start(self, state: Any = None) -> None:
        self.batches = iter(self.loader)
        if state is not None:
            self.batches.set_state(state)

    def next_batch(self) -> tuple[int, np.ndarray]:
        batch = next(self.batches)
        return counted(batch["image"]), np.asarray(batch["index"], dtype=np.int64)

    def state(self) -> Any:
        return self.batches.get_state()  # bytes: JSON


# The rows, in the table's order.
READERS: dict[str, type[Reader]] = {
    reader.name: reader
    for reader in (TpustreamReader, WebLoaderReader, MosaicReader, TorchdataReader, GrainReader)
}
