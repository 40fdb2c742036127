"""The input pipeline end to end on real tar shards (no XLA): exact counts, shuffling, bad data."""

from __future__ import annotations

import io
import itertools
import logging
import re
import time
import uuid
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tests.conftest import make_stream, numbered_samples, png_bytes, solid_image
from tpustream.data.format.tar import ShardFormatError, iter_shard_samples, write_tar
from tpustream.data.read.layout import CanonicalPartition
from tpustream.data.read.loader import CountingLoader, make_loader
from tpustream.data.read.stages import SHARD_ID_SHIFT
from tpustream.data.read.stream import ShardStream
from tpustream.data.resolve.split import load_manifest
from tpustream.errors import DataError, StorageError
from tpustream.training.epoch_checks import check_epoch

SIZE = 8


def stream(folder: str, *, rank=0, world=1, workers=0, train=True, batch=8, **kw) -> ShardStream:
    options = dict(
        batch_size=batch,
        rank=rank,
        world_size=world,
        num_workers=workers,
        train=train,
        seed=7,
        shuffle_buffer=16,
        crop_padding=0,  # keep pixels intact: a sample's value identifies it
        hflip=False,
    )
    options.update(kw)
    return make_stream(load_manifest(folder), **options)


def pixel_ids(batch: dict[str, torch.Tensor]) -> list[tuple[int, bool]]:
    """(sample index encoded in the pixels, is real) for each sample of a batch."""
    values = batch["image"][:, 0, 0, 0].tolist()
    return list(zip(values, (batch["real"] > 0).tolist(), strict=True))


def run_epoch(s: ShardStream, workers: int, epoch: int = 0) -> list[dict[str, torch.Tensor]]:
    s.set_epoch(epoch)
    loader = make_loader(s, workers)
    batches = list(loader)
    loader.raise_if_incomplete("test")
    return batches


@pytest.fixture
def uneven_split(write_split):
    """103 samples in 5 uneven shards; ids 0..102 in the pixels."""
    sizes, start, shards = [40, 3, 25, 1, 34], 0, []
    for n in sizes:
        shards.append(numbered_samples(start, n, SIZE))
        start += n
    return write_split("val", shards, image_size=SIZE)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_exactly_once_across_simulated_replicas(uneven_split, train, workers):
    world, batch = 3, 8
    seen: Counter = Counter()
    padded = 0
    for rank in range(world):
        s = stream(uneven_split, rank=rank, world=world, workers=workers, train=train, batch=batch)
        batches = run_epoch(s, workers)
        assert len(batches) == s.layout.steps == 5  # ceil(103 / 24)
        for b in batches:
            assert b["image"].shape == (batch, 3, SIZE, SIZE) and b["image"].dtype == torch.uint8
            assert b["label"].shape == (batch,) and b["label"].dtype == torch.int64
            for value, real in pixel_ids(b):
                if real:
                    seen[value] += 1
                else:
                    padded += 1
    assert seen == Counter(range(103))
    assert padded == s.layout.padded_samples == 5 * 24 - 103


def test_validation_order_is_fixed_and_labels_match(uneven_split):
    s = stream(uneven_split, train=False)
    first = [pixel_ids(b) for b in run_epoch(s, 0, epoch=0)]
    assert first == [pixel_ids(b) for b in run_epoch(s, 0, epoch=3)]
    values = [v for batch in first for v, real in batch if real]
    assert values == list(range(103))  # manifest order, no shuffle
    for b in run_epoch(s, 0):
        ids = b["image"][:, 0, 0, 0].long()
        assert torch.equal(b["label"], ids % 10)


def test_training_shuffle_is_reproducible_and_changes_every_epoch(uneven_split):
    s = stream(uneven_split, train=True, shuffle_buffer=32)
    orders = [[pixel_ids(b) for b in run_epoch(s, 0, epoch=e)] for e in (0, 1, 0)]
    assert orders[0] == orders[2]
    assert orders[0] != orders[1]
    assert sorted(v for batch in orders[1] for v, real in batch if real) == list(range(103))


def test_drop_policy_runs_whole_global_batches_only(uneven_split):
    s = stream(uneven_split, train=True, last_batch="drop", batch=8, world=2, rank=1)
    batches = run_epoch(s, 0)
    assert len(batches) == 103 // 16
    assert all(real for b in batches for _, real in pixel_ids(b))


def test_raw_format_is_passed_through_exactly(write_split):
    image = np.arange(3 * SIZE * SIZE, dtype=np.uint8).reshape(3, SIZE, SIZE)
    folder = write_split(
        "train", [[("a", {"raw": image.tobytes(), "cls": b"3"})]], image_size=SIZE, image_format="raw"
    )
    (batch,) = run_epoch(stream(folder, train=False, batch=1), 0)
    assert torch.equal(batch["image"][0], torch.from_numpy(image))
    assert batch["label"].tolist() == [3]


def bad_split(write_split, extra_tar: dict[int, bytes] | None = None, counts=None):
    """12 samples over 2 shards, 4 of them bad in different ways."""
    good = numbered_samples(0, 8, SIZE)
    shard0 = good[:4] + [
        ("bad-png", {"png": b"\x89PNG not really", "cls": b"1"}),
        ("no-label", {"png": png_bytes(solid_image(200, SIZE))}),
    ]
    shard1 = good[4:] + [
        ("gif", {"gif": b"GIF89a", "cls": b"2"}),
        ("big-label", {"png": png_bytes(solid_image(201, SIZE)), "cls": b"42"}),
    ]
    return write_split("train", [shard0, shard1], image_size=SIZE, raw_tars=extra_tar, counts=counts)


def test_bad_samples_are_skipped_counted_and_logged_without_changing_steps(write_split, caplog):
    folder = bad_split(write_split)
    s = stream(folder, train=False, batch=4)
    loader = make_loader(s, 0)
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        batches = list(loader)
    loader.raise_if_incomplete("train")
    assert len(batches) == s.layout.steps == 3
    assert loader.filled == 4
    assert [url.rsplit("/", 1)[1] for url in loader.bad_shards] == ["train-000000.tar", "train-000001.tar"]
    real_ids = sorted(v for b in batches for v, real in pixel_ids(b) if real)
    assert real_ids == list(range(8))
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for key, reason in [
        ("bad-png", "cannot decode png"),
        ("no-label", "missing label"),
        ("gif", "cannot decode gif"),  # gif is an image field; these 6 bytes are no image
        ("big-label", "label 42 outside 0..9"),
    ]:
        assert (
            f"train-00000{0 if key in ('bad-png', 'no-label') else 1}.tar sample {key}: {reason}" in messages
        )


def test_bad_samples_raise_with_url_and_key(write_split):
    folder = bad_split(write_split)
    loader = make_loader(stream(folder, train=False, batch=4, on_error="raise"), 0)
    with pytest.raises(DataError, match=r"train-000000\.tar sample bad-png: cannot decode png"):
        list(loader)


@pytest.mark.parametrize("cut", [0, 100], ids=["member-boundary", "mid-member"])
def test_truncated_shard_is_filled_to_the_planned_steps(write_split, caplog, cut):
    full = write_tar((f"{k}.{e}", d) for k, f in numbered_samples(100, 10, SIZE) for e, d in f.items())
    folder = bad_split(write_split, extra_tar={1: full[: len(full) // 2 + cut]}, counts=[6, 10])
    s = stream(folder, train=True, batch=4, workers=0)
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        batches = run_epoch(s, 0)
    assert len(batches) == s.layout.steps == 4  # 16 planned samples
    assert "train-000001.tar: truncated" in caplog.text
    real = sum(int(b["real"].sum()) for b in batches)
    assert real < 16 and all(b["image"].shape[0] == 4 for b in batches)


def test_missing_shard_is_an_error_naming_the_url_whatever_the_policy(write_split, tmp_path):
    folder = write_split(
        "train", [numbered_samples(0, 4, SIZE), numbered_samples(4, 4, SIZE)], image_size=SIZE
    )
    (tmp_path / "shards" / "train" / "train-000001.tar").unlink()
    for workers in (0, 2):
        loader = make_loader(stream(folder, train=False, batch=4, workers=workers), workers)
        # Closed here: the error's traceback keeps the loader alive past the test, and its
        # workers, which ignore SIGTERM, would keep a pytest run without xdist from exiting.
        try:
            with pytest.raises(StorageError) as info:
                list(loader)
        finally:
            loader.close()
        assert str(info.value) == f"{folder}/train-000001.tar: No such file or directory"


def test_a_loader_that_ends_early_is_detected(uneven_split):
    # What torch_xla's ParallelLoader does with a loader exception: stop quietly.
    loader = make_loader(stream(uneven_split, train=False), 0)
    for index, _ in enumerate(loader):
        if index == 1:
            break
    with pytest.raises(DataError, match="yielded 2 of 13 planned batches"):
        loader.raise_if_incomplete("validation")


def test_counting_loader_keeps_filled_out_of_device_batches(uneven_split):
    loader = make_loader(stream(uneven_split, train=False), 0)
    assert isinstance(loader, CountingLoader) and len(loader) == 13
    assert all("filled" not in b for b in loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_recorded_sample_ids_name_each_real_sample_once(uneven_split, workers):
    sizes = [40, 3, 25, 1, 34]
    expected = {(shard << SHARD_ID_SHIFT) | i for shard, n in enumerate(sizes) for i in range(n)}
    seen: Counter = Counter()
    for rank in range(3):
        s = stream(uneven_split, rank=rank, world=3, workers=workers, train=True)
        loader = make_loader(s, workers, record_ids=True)
        for b in loader:
            ids = b.get("sample_id")
            assert ids is None  # host-only: never sent to the device
        seen.update(int(i) for ids in loader.sample_ids for i in ids)
    assert set(seen) == expected and set(seen.values()) == {1}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("skip", [1, 4, 12])
def test_resuming_mid_epoch_yields_exactly_the_remaining_batches(uneven_split, workers, skip):
    options = dict(train=True, batch=8, workers=workers, shuffle_buffer=32, crop_padding=2, hflip=True)
    full = run_epoch(stream(uneven_split, **options), workers, epoch=3)
    resumed = stream(uneven_split, **options)
    resumed.set_epoch(3, skip_batches=skip)
    loader = make_loader(resumed, workers)
    rest = list(loader)
    loader.raise_if_incomplete("train")
    assert len(full) == 13 and len(rest) == 13 - skip
    for a, b in zip(full[skip:], rest, strict=True):
        for key in ("image", "label", "real"):
            assert torch.equal(a[key], b[key])


# Canonical streams: the same global batches on every shape, and from any step on.

CANONICAL = CanonicalPartition(streams=6, stream_buffer=8)
GLOBAL_BATCH = 12  # 2 samples of each stream a step; 103 samples: 9 steps, 5 padded


def global_batches(folder: str, world: int, workers: int, skip: int = 0, **options) -> list[dict]:
    """Epoch 2's global batches from step skip on, built from every replica's readers in process.

    Each worker's pieces (``ShardStream.pieces``) joined in worker order, as the
    loader joins what its DataLoader workers send, then the replicas' batches in rank order.
    """
    replicas = []
    for rank in range(world):
        s = stream(
            folder,
            rank=rank,
            world=world,
            workers=workers,
            batch=GLOBAL_BATCH // world,
            partition=CANONICAL,
            **options,
        )
        s.set_epoch(2, skip_batches=skip)
        pieces = [list(s.pieces(w, max(workers, 1), skip)) for w in range(max(workers, 1))]
        replicas.append([s.join(list(parts)) for parts in zip(*pieces, strict=True)])
    return [
        {key: torch.cat([batch[key] for batch in step]) for key in ("image", "label", "real", "sample_id")}
        for step in zip(*replicas, strict=True)
    ]


# Replicas dividing the 6 streams, and workers up to the streams each replica reads.
SHAPES = [(1, 0), (1, 2), (1, 6), (2, 3), (3, 2), (6, 1), (2, 0)]


def test_canonical_global_batches_are_the_same_on_every_shape_and_resume_from_any_step(uneven_split):
    options = dict(shuffle_buffer=8, crop_padding=2, hflip=True, stages=["tests.user_stages:invert"])
    reference = global_batches(uneven_split, 1, 0, **options)
    assert len(reference) == 9
    real_ids = torch.cat([b["sample_id"][b["real"] > 0] for b in reference])
    assert sorted(real_ids.tolist()) == sorted(set(real_ids.tolist())) and len(real_ids) == 103
    for world, workers, in_memory in [*((w, n, False) for w, n in SHAPES[1:]), (3, 2, True)]:
        for skip in (0, 4):
            batches = global_batches(uneven_split, world, workers, skip, in_memory=in_memory, **options)
            assert len(batches) == 9 - skip, (world, workers, skip)
            for step, (a, b) in enumerate(zip(reference[skip:], batches, strict=True), start=skip):
                for key in a:  # pixels too: crops, flips and the user's stage drawn alike
                    assert torch.equal(a[key], b[key]), (world, workers, in_memory, skip, step, key)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_canonical_pieces_from_dataloader_workers_join_into_the_in_process_batches(uneven_split):
    options = dict(shuffle_buffer=8, crop_padding=2, hflip=True)
    expected = global_batches(uneven_split, 2, 3, skip=3, **options)
    s = stream(uneven_split, rank=1, world=2, workers=3, batch=6, partition=CANONICAL, **options)
    s.set_epoch(2, skip_batches=3)
    loader = make_loader(s, 3, record_ids=True)
    batches = list(loader)
    loader.raise_if_incomplete("train")
    loader.close()
    assert len(batches) == len(loader) == 6
    for a, b, ids in zip(expected, batches, loader.sample_ids, strict=True):
        assert torch.equal(a["image"][6:], b["image"]) and torch.equal(a["label"][6:], b["label"])
        assert torch.equal(a["sample_id"][6:][a["real"][6:] > 0], torch.from_numpy(ids))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_device_draws_are_the_whole_batchs_whichever_workers_send_its_pieces(uneven_split):
    """Mixup pairs and batch-level draws belong to a device's batch (a group of 4 here): pieces
    that split a group get their draws in the replica's process, on the joined batch."""
    from tpustream.config import AugmentConfig

    augment = AugmentConfig(mixup_alpha=0.8, mix_mode="pair", erase_prob=0.5)
    options = dict(augment=augment, augment_group=4)
    reference = stream(uneven_split, batch=12, partition=CANONICAL, **options)
    reference.set_epoch(2)
    expected = list(reference.pieces(0, 1, 0))
    # 4 workers read 2, 2, 1 and 1 streams: pieces of 4, 4, 2 and 2 samples, the last group split.
    split = stream(uneven_split, batch=12, workers=4, partition=CANONICAL, **options)
    assert not split.pieces_draw
    split.set_epoch(2)
    pieces = [list(split.pieces(w, 4, 0)) for w in range(4)]
    for whole, parts in zip(expected, zip(*pieces, strict=True), strict=True):
        joined = split.join(list(parts))
        assert whole.keys() == joined.keys() and "mix_lam" in joined
        assert whole["key"] == joined["key"]
        for key in whole.keys() - {"bad_shards", "filled", "key"}:
            assert torch.equal(whole[key], joined[key]), key
    # The same through DataLoader workers, whose pieces meet in the replica's shared slots.
    loader = make_loader(split, 4)
    try:
        received = list(loader.assembled())
    finally:
        loader.close()
    assert len(received) == len(expected)
    for whole, joined in zip(expected, received, strict=True):
        assert "mix_lam" in joined
        assert whole["key"] == joined["key"]
        for key in whole.keys() - {"bad_shards", "filled", "key"}:
            assert torch.equal(whole[key], joined[key]), key


def test_a_canonical_stream_fills_its_own_bad_samples_whoever_reads_it(write_split, caplog):
    folder = bad_split(write_split)
    reference = global_batches(folder, 1, 0)
    for world, workers in ((2, 3), (3, 2)):
        for a, b in zip(reference, global_batches(folder, world, workers), strict=True):
            assert torch.equal(a["real"], b["real"]) and torch.equal(a["sample_id"], b["sample_id"])
    assert sum(int((b["real"] == 0).sum()) for b in reference) > 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_workers_fill_bad_samples_places_with_the_images_the_training_process_would(write_split):
    """Pad-cropped and flipped batches short of samples: the places are filled from the images
    before augmentation, whether the batch is made in process or written into the shared slots
    (batch norm sees the fills, so they must be the same for a resume on another shape)."""
    shards = [
        numbered_samples(start, 10, SIZE) + [("bad-png", {"png": b"\x89PNG not really", "cls": b"1"})]
        for start in (0, 10)
    ]
    folder = write_split("train", shards, image_size=SIZE)  # 22 samples: 2 steps of 12, streams of 4
    options = dict(crop_padding=2, hflip=True, shuffle_buffer=4)
    expected = global_batches(folder, 1, 3, **options)
    s = stream(folder, workers=3, batch=GLOBAL_BATCH, partition=CANONICAL, **options)
    s.set_epoch(2)
    loader = make_loader(s, 3)
    try:
        received = list(loader.assembled())
    finally:
        loader.close()
    assert sum(int((b["real"] == 0).sum()) for b in expected) > 0
    for a, b in zip(expected, received, strict=True):
        assert torch.equal(a["real"], b["real"]) and torch.equal(a["image"], b["image"])
    # The per-reader plan (data.streams=0): each worker's whole batches, round-robin.
    s = stream(folder, workers=3, batch=4, **options)
    s.set_epoch(2)
    per_worker = [list(s.pipeline(w, 3, 0)) for w in range(3)]
    expected = [b for step in itertools.zip_longest(*per_worker) for b in step if b is not None]
    loader = make_loader(s, 3)
    try:
        received = list(loader.assembled())
    finally:
        loader.close()
    assert s.slots is not None and s.slots.slots >= 2 * 3  # two of each worker's batches
    assert sum(int((b["real"] == 0).sum()) for b in expected) > 0
    for a, b in zip(expected, received, strict=True):
        assert torch.equal(a["real"], b["real"]) and torch.equal(a["image"], b["image"])


# In-memory mode: the same batches as streaming, from one shared copy of the split.


def raw_batches(
    s: ShardStream, workers: int, epochs: list[int], skip: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Every field of every batch (filled and sample_id included) of the given epochs, in order.

    The first epoch resumes after `skip` batches, as a restarted run would.
    """
    loader = make_loader(s, workers)
    batches = []
    for index, epoch in enumerate(epochs):
        s.set_epoch(epoch, skip_batches=skip if index == 0 else 0)
        # Whole batches with every field (CountingLoader's iteration pops
        # filled and sample_id), and a loop rather than list(): list() asks
        # len() after the iterator has taken its length, which makes
        # DataLoader warn after set_epoch.
        for batch in loader.assembled():
            assert batch.pop("made") <= time.monotonic()  # when it was made: differs run to run
            batches.append(batch)
    loader.close()
    return batches


def assert_same_batches(
    expected: list[dict[str, torch.Tensor]], actual: list[dict[str, torch.Tensor]]
) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(expected, actual, strict=True):
        assert a.keys() == b.keys() == {"image", "label", "real", "filled", "sample_id", "key", "bad_shards"}
        assert a["key"] == b["key"]
        for key in a.keys() - {"bad_shards", "key"}:  # from memory, bad data was reported once, at loading
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize(
    ("world", "workers", "epoch", "skip", "train"),
    [
        (1, 0, 0, 0, True),
        (1, 2, 1, 5, True),
        (3, 0, 2, 1, True),
        (3, 2, 0, 2, True),
        (2, 3, 5, 4, True),
        (3, 2, 1, 0, False),
        (2, 0, 0, 3, False),
    ],
)
def test_memory_batches_equal_streamed_batches(uneven_split, world, workers, epoch, skip, train):
    options = dict(world=world, workers=workers, train=train, shuffle_buffer=32, crop_padding=2, hflip=True)
    for rank in range(world):
        streamed = stream(uneven_split, rank=rank, **options)
        in_memory = stream(uneven_split, rank=rank, in_memory=True, **options)
        expected = raw_batches(streamed, workers, [epoch, epoch + 1], skip)
        assert len(expected) == 2 * streamed.layout.steps - skip
        assert_same_batches(expected, raw_batches(in_memory, workers, [epoch, epoch + 1], skip))


@pytest.mark.parametrize("split", ["train", "test"])
def test_memory_batches_equal_streamed_batches_on_digits(digits_root, split):
    options = dict(
        batch_size=32, world_size=2, num_workers=0, train=split == "train", seed=3, shuffle_buffer=200
    )
    manifest = load_manifest(f"{digits_root}/{split}")
    for rank in range(2):
        expected = raw_batches(make_stream(manifest, rank=rank, **options), 0, [1])
        in_memory = make_stream(manifest, rank=rank, in_memory=True, **options)
        assert in_memory.memory.images.shape == (manifest.num_samples, 3, 32, 32)
        assert_same_batches(expected, raw_batches(in_memory, 0, [1]))


def test_memory_reads_the_shards_once_and_logs_the_load(uneven_split, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tpustream.data.read.memory"):
        s = stream(uneven_split, train=True, in_memory=True)
    assert re.search(
        r"val split in memory: 103 of 103 listed samples, [\d.]+ MB shared, loaded in", caplog.text
    )
    assert s.memory.nbytes == 103 * (3 * SIZE * SIZE + 8 + 8)
    for shard in (tmp_path / "shards" / "val").glob("*.tar"):
        shard.unlink()
    for epoch in (0, 1):
        assert len(run_epoch(s, 0, epoch)) == 13


def truncated_split(write_split, cut: int, corrupt: bool) -> str:
    """16 listed samples over 2 shards; the second cut off about half way, at or after a member boundary.

    With corrupt, the first shard also holds samples that do not decode (bad_split's).
    """
    full = write_tar((f"{k}.{e}", d) for k, f in numbered_samples(100, 10, SIZE) for e, d in f.items())
    truncated = {1: full[: len(full) // 2 + cut]}
    if corrupt:
        return bad_split(write_split, extra_tar=truncated, counts=[6, 10])
    shards = [numbered_samples(0, 6, SIZE), numbered_samples(100, 10, SIZE)]
    return write_split("train", shards, image_size=SIZE, raw_tars=truncated)


@pytest.mark.parametrize("cut", [0, 100], ids=["member-boundary", "mid-member"])
@pytest.mark.parametrize(
    ("world", "workers", "train", "skip"),
    [(1, 0, False, 0), (1, 0, True, 1), (2, 0, False, 0), (2, 0, True, 1), (2, 2, True, 0), (1, 2, False, 1)],
)
def test_memory_handles_bad_data_as_streaming_does(write_split, caplog, cut, world, workers, train, skip):
    folder = truncated_split(write_split, cut, corrupt=True)
    options = dict(world=world, batch=4, workers=workers, train=train, crop_padding=2, hflip=True)
    filled = 0
    for rank in range(world):
        expected = raw_batches(stream(folder, rank=rank, **options), workers, [0], skip)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
            in_memory = stream(folder, rank=rank, in_memory=True, **options)
            assert_same_batches(expected, raw_batches(in_memory, workers, [0], skip))
        # Reported once, when the split is loaded, not again by the workers.
        assert caplog.text.count("train-000000.tar sample bad-png: cannot decode png") == 1
        assert caplog.text.count("train-000001.tar: truncated") == 1
        filled += sum(int(b["filled"]) for b in expected)
    assert filled > 0


@pytest.mark.parametrize("fault", ["bad-sample", "member-boundary", "mid-member"])
def test_memory_raises_the_streamed_error_when_loading(write_split, fault):
    if fault == "bad-sample":
        folder = bad_split(write_split)
    else:
        folder = truncated_split(write_split, 0 if fault == "member-boundary" else 100, corrupt=False)
    options = dict(train=False, batch=4, on_error="raise")
    with pytest.raises(DataError) as streamed:
        list(make_loader(stream(folder, **options), 0))
    with pytest.raises(DataError) as in_memory:
        stream(folder, in_memory=True, **options)
    assert str(in_memory.value) == str(streamed.value)
    assert str(streamed.value).startswith(f"{folder}/train-00000{0 if fault == 'bad-sample' else 1}.tar")


def test_memory_is_shared_with_spawned_workers_not_copied(uneven_split):
    s = stream(uneven_split, train=False, workers=2, in_memory=True)
    images = s.memory.images
    assert all(t.is_shared() for t in (images, s.memory.labels, s.memory.rows))
    # As in an xmp.spawn replica: workers started with "spawn" receive the
    # stream by pickling, and keep that copy of the object between epochs
    # (persistent). data_ptr cannot tell (each process maps the memory at its
    # own address), so: write to the images in this process only, between two
    # passes. Workers that share the memory serve the new pixels; workers
    # holding a copy would serve the old ones.
    loader = CountingLoader(
        DataLoader(
            s, batch_size=None, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
        )
    )
    try:
        before = [b["image"].clone() for b in loader]
        images.bitwise_not_()
        after = [b["image"] for b in loader]
    finally:
        loader.close()
    assert len(before) == len(after) == 13
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new, torch.bitwise_not(old))


def test_a_span_of_a_damaged_shard_delivers_what_reading_the_whole_shard_delivered():
    # What read_memory_samples relies on: reading samples [start, stop) of a
    # truncated or corrupt shard yields start..min(stop, k)-1, where k is what
    # reading all listed samples yields, and fails iff that read failed and
    # stop > k. So spans can be served from one whole-shard read.
    full = write_tar((f"{k}.{e}", d) for k, f in numbered_samples(0, 6, SIZE) for e, d in f.items())
    damaged = [full[:cut] for cut in range(0, len(full), 97)]
    damaged += [full[:at] + b"garbage!" * 64 + full[at + 512 :] for at in range(0, len(full) - 512, 512 * 3)]

    def read(data: bytes, start: int, stop: int) -> tuple[list[int], bool]:
        indices = []
        try:
            for sample in iter_shard_samples(io.BytesIO(data), "shard", start, stop):
                indices.append(sample["__index__"])
        except ShardFormatError:
            return indices, True
        return indices, False

    for data in damaged:
        whole, failed = read(data, 0, 6)
        for start in range(6):
            for stop in range(start + 1, 7):
                expected = (list(range(start, min(stop, len(whole)))), failed and stop > len(whole))
                assert read(data, start, stop) == expected, (len(data), start, stop)


# Counts that lie: a shard holding fewer or more samples than its recorded count.


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    # per shard: (samples it holds, recorded count minus that)
    shards=st.lists(st.tuples(st.integers(0, 9), st.integers(-3, 3)), min_size=1, max_size=5),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch=st.integers(1, 5),
    train=st.booleans(),
)
def test_counts_that_lie_keep_steps_equal_and_samples_exact(
    write_split, caplog, shards, world, workers, batch, train
):
    held = [n for n, _ in shards]
    listed = [max(0, n + lie) for n, lie in shards]
    assume(sum(listed) > 0)
    start, contents = 0, []
    for n in held:
        contents.append(numbered_samples(start, n, SIZE))
        start += n
    name = f"lie{uuid.uuid4().hex[:8]}"
    folder = write_split(name, contents, image_size=SIZE, counts=listed)
    seen: Counter = Counter()
    filled = 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        for rank in range(world):
            s = stream(
                folder, rank=rank, world=world, workers=workers, train=train, batch=batch, shuffle_buffer=4
            )
            # The DataLoader workers' pipelines, run here one after the other.
            batches = [b for worker in range(workers) for b in s.pipeline(worker, workers, 0)]
            assert len(batches) == s.layout.steps  # equal steps, whatever the shards hold
            filled += sum(int(b["filled"]) for b in batches)
            seen.update(int(i) for b in batches for i in b["sample_id"][b["real"] > 0])
    # Every sample the counts allow is used exactly once, nothing past a count ever;
    # each listed sample a shard lacks leaves a place that is filled (not real).
    usable = {(k << SHARD_ID_SHIFT) | i for k in range(len(held)) for i in range(min(held[k], listed[k]))}
    assert set(seen) == usable and set(seen.values()) <= {1}
    assert filled >= sum(max(0, c - n) for n, c in zip(held, listed, strict=True))
    for k, (n, c) in enumerate(zip(held, listed, strict=True)):
        url = f"{folder}/{name}-{k:06d}.tar"
        if n > c > 0:
            assert f"{url}: holds more samples than its recorded count ({c}); only the first" in caplog.text
        if n < c:
            assert f"{url}: holds " in caplog.text and f"but its recorded count is {c}" in caplog.text


def test_a_count_mismatch_is_an_error_under_raise(write_split):
    short = write_split("short", [numbered_samples(0, 4, SIZE)], image_size=SIZE, counts=[6])
    with pytest.raises(DataError, match=r"short-000000\.tar: holds 4 samples, but its recorded count is 6"):
        list(make_loader(stream(short, train=False, batch=2, on_error="raise"), 0))
    long = write_split("long", [numbered_samples(0, 4, SIZE)], image_size=SIZE, counts=[3])
    with pytest.raises(
        DataError, match=r"long-000000\.tar: holds more samples than its recorded count \(3\)"
    ):
        list(make_loader(stream(long, train=False, batch=3, on_error="raise"), 0))


# The user's own webdataset stages (data.stages).


@pytest.mark.parametrize("train", [False, True])
def test_a_resumed_epoch_counts_the_samples_a_shard_lacks_once(write_split, train):
    folder = truncated_split(write_split, 0, corrupt=False)  # 16 listed, the second shard cut short
    options = dict(train=train, batch=4, shuffle_buffer=4)
    full = [int(b["filled"]) for b in raw_batches(stream(folder, **options), 0, [0])]
    assert sum(full) > 0
    for skip in range(1, len(full)):
        rest = [int(b["filled"]) for b in raw_batches(stream(folder, **options), 0, [0], skip)]
        assert sum(full[:skip]) + sum(rest) == sum(full), skip


@pytest.mark.parametrize("workers", [0, 2])
def test_user_stages_run_on_decoded_samples_in_order(uneven_split, workers):
    plain = run_epoch(stream(uneven_split, train=False, workers=workers), workers)
    staged = stream(
        uneven_split,
        train=False,
        workers=workers,
        stages=["tests.user_stages:drop_label_three", "tests.user_stages.invert"],
    )
    loader = make_loader(staged, workers)
    batches = list(loader)
    assert len(batches) == len(plain) == staged.layout.steps  # dropping samples never changes the steps
    kept = [255 - v for b in batches for v, real in pixel_ids(b) if real]
    expected = [v for b in plain for v, real in pixel_ids(b) if real and v % 10 != 3]
    # Workers fill their own dropped places, so with several the interleaving shifts.
    assert kept == expected if workers == 0 else sorted(kept) == sorted(expected)
    assert loader.filled == sum(1 for v in range(103) if v % 10 == 3)


def test_a_user_stage_that_changes_the_image_shape_is_an_error_naming_it(uneven_split):
    from tpustream.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tests.user_stages:shrink.*must stay uint8 \(3, 8, 8\)"):
        list(make_loader(stream(uneven_split, train=False, stages=["tests.user_stages:shrink"]), 0))


# Padding repeats the epoch's first samples to fill the last global batch: never data, good or bad.


@pytest.mark.parametrize("in_memory", [False, True], ids=["streamed", "in-memory"])
@pytest.mark.parametrize("fault", ["label", "truncated"])
def test_padding_never_counts_or_logs_a_bad_sample_again(write_split, caplog, in_memory, fault):
    # 30 listed samples, batch 20: 40 places, the last 10 repeat samples 0..9,
    # of which two are bad (labels 42, or missing from a shard that lists 10).
    first, rest = numbered_samples(0, 10, SIZE), numbered_samples(10, 20, SIZE)
    if fault == "label":
        for _, fields in first[3:5]:
            fields["cls"] = b"42"
        folder = write_split("val", [first, rest], image_size=SIZE)
        reports = ["sample 000003: label 42 outside 0..9", "sample 000004: label 42 outside 0..9"]
    else:
        folder = write_split("val", [first[:8], rest], image_size=SIZE, counts=[10, 20])
        reports = ["holds 8 samples, but its recorded count is 10"]
    loader = make_loader(stream(folder, train=False, batch=20, in_memory=in_memory), 0)
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        batches = list(loader)
    real = sum(int(b["real"].sum()) for b in batches)
    assert (loader.filled, real) == (2, 28)  # bad and good real samples add up to the split's 30
    for report in reports:
        assert caplog.text.count(report) == 1
    with pytest.raises(DataError, match=r"validation: 2 of 30 samples \(6\.7%\) were bad"):
        check_epoch(0, {"val_samples": real, "val_filled": loader.filled}, 0.01, True)


def test_labels_out_of_user_stages_are_range_checked_as_bad_samples(uneven_split, caplog):
    loader = make_loader(stream(uneven_split, train=False, stages=["tests.user_stages:label_42"]), 0)
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        batches = list(loader)
    real = sum(int(b["real"].sum()) for b in batches)
    assert (loader.filled, real) == (103, 0)  # all 103 real samples bad, padding not counted
    assert "val-000000.tar sample #0: label 42 outside 0..9 after data.stages" in caplog.text
    with pytest.raises(DataError, match=r"validation: 103 of 103 samples \(100\.0%\) were bad"):
        check_epoch(0, {"val_samples": real, "val_filled": loader.filled}, 0.01, True)
    raising = stream(uneven_split, train=False, stages=["tests.user_stages:label_42"], on_error="raise")
    with pytest.raises(DataError, match=r"val-000000\.tar sample #\d+: label 42 outside 0\.\.9"):
        list(make_loader(raising, 0))


def test_a_user_stage_cannot_add_samples_to_the_plan(uneven_split, caplog):
    plain = run_epoch(stream(uneven_split, train=False), 0)
    loader = make_loader(stream(uneven_split, train=False, stages=["tests.user_stages:twice"]), 0)
    with caplog.at_level(logging.WARNING, logger="tpustream.data.read.stages"):
        batches = list(loader)
    assert len(batches) == len(plain) == 13
    # Every sample once, as without the stage (not the first half of the split twice).
    assert [pixel_ids(b) for b in batches] == [pixel_ids(b) for b in plain]
    assert loader.filled == 103  # the copies of the real samples, dropped
    assert caplog.text.count("data.stages entry 'tests.user_stages:twice' yielded more samples") == 1
    raising = stream(uneven_split, train=False, stages=["tests.user_stages:twice"], on_error="raise")
    with pytest.raises(DataError, match=r"'tests.user_stages:twice' yielded more samples than it was given"):
        list(make_loader(raising, 0))


def test_a_user_stage_must_keep_the_padding_flag(uneven_split):
    from tpustream.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tests.user_stages:fresh_dicts.*without its '__real__' key"):
        list(make_loader(stream(uneven_split, train=False, stages=["tests.user_stages:fresh_dicts"]), 0))


def pass_waits(loader: CountingLoader, epoch: int) -> float:
    """The share of the pass's waits for batches not yet made (the loader's BatchWaits)."""
    loader.set_epoch(epoch)
    for _ in loader:
        pass
    share = loader.waits.making_share()
    assert share is not None and loader.waits.seconds > 0
    return share


def test_the_loader_tells_waits_for_slow_workers_from_waits_for_a_slow_delivery(uneven_split, monkeypatch):
    """Workers making batches slowly: the waits were for the making; workers ahead of a slow
    receiving thread: for the delivery (measured on 2 cores: 0.99 and 0.02)."""
    from tpustream.data.read import assemble

    slow = make_loader(
        stream(uneven_split, train=False, batch=4, workers=2, stages=["tests.user_stages:slow"]), 2
    )
    assert pass_waits(slow, 0) > 0.7  # 4 samples of 30 ms a batch, nothing after
    slow.close()

    join = assemble.join_pieces

    def slow_join(pieces: list[dict]) -> dict:
        time.sleep(0.04)  # the receiving thread, 40 ms a batch; the workers, a few ms
        return join(pieces)

    monkeypatch.setattr(assemble, "join_pieces", slow_join)
    late = make_loader(stream(uneven_split, train=False, batch=4, workers=2), 2)
    pass_waits(late, 0)  # its first waits may include the workers' start-up: making
    assert pass_waits(late, 1) < 0.3
    late.close()


def test_closing_a_loader_ends_a_worker_stuck_in_a_stage(uneven_split, tmp_path, monkeypatch):
    """The workers ignore SIGTERM (their replica decides when to stop), so one that cannot see the
    request to leave (a stage blocked in a read) is killed: its process would never be joined.
    Where they are is asked as a replica's watchdog asks (their faulthandler dumps)."""
    from torch.utils.data import _utils

    from tpustream import watchdog
    from tpustream.watchdog.stacks import dump_workers

    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)  # DataLoader's join of each worker: 5 s

    reports = watchdog.Reports(str(tmp_path))
    limits = watchdog.Limits(steady=1e6, first_step=1e6, stop_grace=0, enabled=True)
    dog = watchdog.Watchdog(limits, 0, str(tmp_path), reports=reports, on_fire=lambda _: None)
    watchdog.start_watchdog(dog)
    try:
        blocking = stream(uneven_split, train=False, workers=1, stages=["tests.user_stages:block_forever"])
        loader = make_loader(blocking, 1)  # its worker writes its stacks where the watchdog reads them
        loader.start_workers()
        workers = list(loader.loader._iterator._workers)
        deadline = time.monotonic() + 120
        while True:
            dumps = [dump for _, dump in dump_workers(dog.worker_dumps_folder())]
            if len(dumps) == 1 and "block_forever" in dumps[0]:
                break
            assert time.monotonic() < deadline, "the worker never reached the stage"
        loader.close()
    finally:
        watchdog.stop_watchdog(dog)
    assert not any(worker.is_alive() for worker in workers)
