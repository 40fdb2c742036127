"""The input pipeline end to end on real tar shards (no XLA): exact counts, shuffling, bad data."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch

from tests.conftest import numbered_samples, png_bytes, solid_image
from tpustream.data.manifest import load_manifest
from tpustream.data.pipeline import SHARD_ID_SHIFT, CountingLoader, ShardStream, make_loader
from tpustream.data.tar_stream import write_tar
from tpustream.errors import DataError, StorageError

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
    return ShardStream(load_manifest(folder), **options)


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
    with caplog.at_level(logging.WARNING, logger="tpustream.data.pipeline"):
        batches = list(loader)
    loader.raise_if_incomplete("train")
    assert len(batches) == s.layout.steps == 3
    assert loader.filled == 4
    real_ids = sorted(v for b in batches for v, real in pixel_ids(b) if real)
    assert real_ids == list(range(8))
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for key, reason in [
        ("bad-png", "cannot decode png"),
        ("no-label", "missing label"),
        ("gif", "no png field (fields: cls, gif)"),
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
    with caplog.at_level(logging.WARNING, logger="tpustream.data.pipeline"):
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
        with pytest.raises(StorageError) as info:
            list(loader)
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
