"""tpustream.data.ShardLoader: a plain loop's exact epochs, equal steps and elastic resume.

Ranks here are loaders of one process with rank=/world_size= given (readers of the
same files, as torchrun's processes are); the last test runs two processes under
torchrun, where rank and world size come from torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import numpy as np
import pytest
import torch

from tests.conftest import REPO
from tpustream.config import LastBatch
from tpustream.data import ShardLoader
from tpustream.errors import ConfigError

# The last 3 shards of the digits' training split (256 + 256 + 158 samples): 11 global batches
# of 64, the last one padded.
TRAIN = "train/train-{000003..000005}.tar"
TRAIN_SAMPLES = 670
STEPS = 11


def loaders(root: str, ranks: int, batch: int, **options) -> list[ShardLoader]:
    return [
        ShardLoader(
            f"{root}/{TRAIN}", batch_size=batch, rank=r, world_size=ranks, num_workers=0, seed=3, **options
        )
        for r in range(ranks)
    ]


def global_batches(ranks: list[ShardLoader], stop: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ranks' next pass side by side: (sample ids, real) of each global batch, in rank order."""
    passes = [iter(loader) for loader in ranks]
    out = []
    for batches in zip(*passes, strict=True):  # equal steps: a rank with more or fewer fails here
        ids = np.concatenate([b["sample_id"].numpy() for b in batches])
        real = np.concatenate([b["real"].numpy() for b in batches])
        out.append((ids, real))
        if stop is not None and ranks[0].step == stop:
            for p in passes:  # cut short, as a loop that breaks
                p.close()
            break
    return out


def test_every_sample_once_an_epoch_across_the_ranks_in_equal_steps(digits_root):
    ranks = loaders(digits_root, 2, 32)
    assert [len(r) for r in ranks] == [STEPS, STEPS]  # ceil(670 / 64) on every rank
    batch = next(iter(loaders(digits_root, 2, 32)[1]))
    assert batch["image"].dtype == torch.uint8 and tuple(batch["image"].shape) == (32, 3, 32, 32)
    assert (
        batch["label"].dtype == batch["sample_id"].dtype == torch.int64 and batch["real"].dtype == torch.bool
    )
    epochs = []
    for epoch in range(2):
        for r in ranks:
            r.set_epoch(epoch)
        steps = global_batches(ranks)
        assert len(steps) == STEPS and all(r.epoch == epoch + 1 and r.step == 0 for r in ranks)
        real = np.concatenate([ids[mask] for ids, mask in steps])
        counts = Counter(real.tolist())
        assert len(counts) == TRAIN_SAMPLES and set(counts.values()) == {1}
        assert sum(int((~mask).sum()) for _, mask in steps) == STEPS * 64 - TRAIN_SAMPLES  # padding, marked
        epochs.append(np.concatenate([ids for ids, _ in steps]))
    assert not np.array_equal(epochs[0], epochs[1])  # each epoch its own order


def test_a_state_taken_mid_epoch_continues_the_same_global_batches_on_other_ranks(digits_root):
    # 4 canonical streams (auto takes one a rank here, a stream starting on a shard of its own):
    # 1, 2 or 4 ranks can continue them.
    straight = global_batches(loaders(digits_root, 2, 32, streams=4))
    stopped = loaders(digits_root, 2, 32, streams=4)
    before = global_batches(stopped, stop=5)
    state = json.loads(json.dumps(stopped[0].state_dict()))  # JSON all the way, as a checkpoint keeps it
    assert state == stopped[1].state_dict() and len(json.dumps(state)) < 1024
    assert (state["epoch"], state["step"]) == (0, 5)
    for ranks, batch in ((1, 64), (4, 16)):
        resumed = loaders(digits_root, ranks, batch)
        for r in resumed:
            r.load_state_dict(state)
            assert (r.epoch, r.step) == (0, 5)
            r.set_epoch(r.epoch)  # the documented loop calls it: the position stays
        after = global_batches(resumed)
        assert len(after) == STEPS - 5
        for (got, got_real), (want, want_real) in zip(before + after, straight, strict=True):
            assert np.array_equal(got, want) and np.array_equal(got_real, want_real)


def test_shards_stream_from_a_bucket(digits_bucket):
    loader = ShardLoader(f"{digits_bucket}/digits/{TRAIN}", batch_size=64, num_workers=0, seed=3)
    real = np.concatenate([b["sample_id"][b["real"]].numpy() for b in loader])
    assert len(real) == len(set(real.tolist())) == TRAIN_SAMPLES and loader.epoch == 1


def test_workers_change_the_speed_not_the_batches(digits_root):
    without = ShardLoader(f"{digits_root}/{TRAIN}", batch_size=64, num_workers=0, seed=3)
    with ShardLoader(f"{digits_root}/{TRAIN}", batch_size=64, num_workers=2, seed=3) as workers:
        got = [(b["sample_id"].numpy(), b["image"].numpy(), b["key"]) for b in workers]
    want = [(b["sample_id"].numpy(), b["image"].numpy(), b["key"]) for b in without]
    assert len(got) == len(want) == STEPS
    for (ids, images, keys), (want_ids, want_images, want_keys) in zip(got, want, strict=True):
        assert np.array_equal(ids, want_ids) and np.array_equal(images, want_images) and keys == want_keys
    # Each sample's __key__ (the digits' are its number, 00000768 ..), the same for its every place.
    key_of = {}
    for ids, _, keys in got:
        assert len(keys) == len(ids)
        for sample_id, key in zip(ids.tolist(), keys, strict=True):
            assert key_of.setdefault(sample_id, key) == key and len(key) == 8 and key.isdigit()
    assert len(set(key_of.values())) == len(key_of) == TRAIN_SAMPLES


def test_a_validation_split_is_read_once_in_order_across_the_ranks(digits_root):
    ranks = [
        ShardLoader(f"{digits_root}/test", batch_size=50, train=False, rank=r, world_size=3, num_workers=0)
        for r in range(3)
    ]
    steps = global_batches(ranks)
    assert len(steps) == 3  # ceil(359 / 150)
    real = np.concatenate([ids[mask] for ids, mask in steps])
    assert sorted(real.tolist()) == sorted(set(real.tolist())) and len(real) == 359
    assert "streams" not in ranks[0].state_dict()  # no canonical partition: read in order
    # train.py's validation loader, whose data section drops training's last batch, pads all the same.
    manifest, dropping = ranks[0].manifest, dataclasses.replace(ranks[0].data, last_batch=LastBatch.drop)
    plan = dict(batch_size=50, rank=0, world_size=3, seed=0, partition=None)
    assert ShardLoader.of_split(manifest, dropping, train=False, **plan).steps == 3
    assert ShardLoader.of_split(manifest, dropping, train=True, **plan).steps == 2  # floor(359 / 150)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: ShardLoader(f"{root}/nowhere", batch_size=8), "nowhere"),
        (lambda root: ShardLoader(f"{root}/train", batch_size=8, rank=2, world_size=2), "rank 2 is outside"),
        (lambda root: ShardLoader(f"{root}/train", batch_size=0), "batch_size must be at least 1"),
        (lambda root: ShardLoader(f"{root}/train", batch_size=8, crop="center"), "crop='center'; expected"),
    ],
    ids=["missing-folder", "rank-outside", "no-batch", "unknown-crop"],
)
def test_bad_arguments_are_one_line_naming_them(digits_root, make, message):
    with pytest.raises(ConfigError, match=message) as raised:
        make(digits_root)
    assert "\n" not in str(raised.value)


def test_a_state_of_another_dataset_seed_or_global_batch_is_refused_naming_it(digits_root):
    (state,) = [r.state_dict() for r in loaders(digits_root, 1, 64)]
    other_seed = ShardLoader(f"{digits_root}/{TRAIN}", batch_size=64, num_workers=0, seed=4)
    with pytest.raises(ConfigError, match="the state's seed is 3, this loader's 4"):
        other_seed.load_state_dict(state)
    smaller = ShardLoader(f"{digits_root}/{TRAIN}", batch_size=32, num_workers=0, seed=3)
    with pytest.raises(ConfigError, match="global batch is 64, .*: set batch_size=64"):
        smaller.load_state_dict(state)
    other_data = ShardLoader(f"{digits_root}/test", batch_size=64, num_workers=0, seed=3)
    with pytest.raises(
        ConfigError, match=r"another dataset \(670 samples in 3 shard\(s\)\); this loader reads 359"
    ):
        other_data.load_state_dict(state)
    with pytest.raises(ConfigError, match="not a ShardLoader state"):
        other_data.load_state_dict({"epoch": 1})
    # Ranks that do not divide the state's canonical streams (auto: 2 for 2 ranks of 3 shards).
    (two_streams, _) = [r.state_dict() for r in loaders(digits_root, 2, 32)]
    with pytest.raises(ConfigError, match="4 replica.s. cannot share the run's 2 canonical streams"):
        loaders(digits_root, 4, 16)[0].load_state_dict(two_streams)


def test_shards_without_counts_are_counted_by_rank_0_while_the_others_wait(
    digits_root, tmp_path, monkeypatch
):
    from tpustream.data.resolve import split

    monkeypatch.setattr(split, "INDEX_POLL_SECONDS", 0.05)
    folder = tmp_path / "unindexed"
    folder.mkdir()
    for name in ("train-000004.tar", "train-000005.tar"):  # 256 + 158 samples, no manifest
        shutil.copy(f"{digits_root}/train/{name}", folder)
    made: dict[int, ShardLoader] = {}
    waiting = threading.Thread(
        target=lambda: made.update(
            {1: ShardLoader(str(folder), batch_size=8, rank=1, world_size=2, num_classes=10)}
        )
    )
    waiting.start()  # rank 1 first: it finds no counts and waits for rank 0's index
    made[0] = ShardLoader(str(folder), batch_size=8, rank=0, world_size=2, num_classes=10)
    waiting.join(60)
    assert not waiting.is_alive() and made[1].manifest.num_samples == made[0].manifest.num_samples == 414
    assert made[1].state_dict()["dataset"] == made[0].state_dict()["dataset"]


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from tpustream.data import ShardLoader

    dist.init_process_group("gloo")
    # rank and world size: torch.distributed's
    loader = ShardLoader(sys.argv[1], batch_size=32, num_workers=0, seed=3)
    ids = [b["sample_id"][b["real"]].tolist() for b in loader]
    # A file per rank: two ranks' long lines on one stdout pipe can interleave (seen once).
    with open(f"{sys.argv[2]}/rank{loader.rank}.json", "w") as report:
        report.write(json.dumps({"rank": loader.rank, "world": loader.world_size, "steps": len(ids),
                                 "ids": sum(ids, [])}))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_under_torchrun_the_ranks_come_from_torch_distributed(digits_root, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(script), f"{digits_root}/{TRAIN}", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted((r["rank"], r["world"], r["steps"]) for r in reports) == [(0, 2, STEPS), (1, 2, STEPS)]
    counts = Counter(i for r in reports for i in r["ids"])
    assert len(counts) == TRAIN_SAMPLES and set(counts.values()) == {1}
