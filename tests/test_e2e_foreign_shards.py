"""End to end on the XLA CPU device with shards other tools wrote: no tpustream manifest anywhere.

Digits written as the WebDataset ecosystem writes them: webdataset's own
ShardWriter (ppm + cls, the reference CIFAR notebook's layout), an
img2dataset-style set (jpg + txt + json, <shard>_stats.json) with bad samples
mixed in, and a wids shard index over .tar.gz shards; local and gs://.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from tests.conftest import run_train
from tpustream import storage
from tpustream.checkpoint import load_checkpoint, read_metrics
from tpustream.data.format.tar import write_tar
from tpustream.data.resolve.counting import INDEX_NAME
from tpustream.data.write.image_sources import digits_splits

pytestmark = pytest.mark.slow


def digits_pil(split: str) -> list[tuple[Image.Image, int]]:
    source = {s.name: s for s in digits_splits()}[split]
    return [
        (Image.fromarray(np.asarray(im).transpose(1, 2, 0)), int(y))
        for im, y in zip(source.images, source.labels, strict=True)
    ]


def jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=95)
    return out.getvalue()


def write_shard_writer_split(folder: str, split: str) -> None:
    """webdataset.ShardWriter, as the reference notebook: %07d keys, ppm image, int cls."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, f"digits-{split}-%06d.tar"), maxcount=400, verbose=0) as sink:
        for i, (image, label) in enumerate(digits_pil(split)):
            sink.write({"__key__": f"{i:07d}", "ppm": image, "cls": label})


def write_img2dataset_split(prefix: str, split: str, bad_every: int) -> None:
    """img2dataset's layout: 00000.tar of <key>.jpg/.txt/.json, and 00000_stats.json; some samples bad."""
    samples = digits_pil(split)
    for shard, first in enumerate(range(0, len(samples), 500)):
        members = []
        for i in range(first, min(first + 500, len(samples))):
            image, label = samples[i]
            key = f"{shard:05d}{i - first:04d}"
            data = b"\xff\xd8 not a jpeg" if i % bad_every == 0 else jpeg(image)
            members += [
                (f"{key}.jpg", data),
                (f"{key}.txt", f"a photo of the digit {label}".encode()),
                (f"{key}.json", json.dumps({"key": key, "status": "success", "label": label}).encode()),
            ]
        storage.write_bytes(f"{prefix}/{shard:05d}.tar", write_tar(members))
        stats = {"count": len(members) // 3, "successes": len(members) // 3, "failed_to_download": 0}
        storage.write_bytes(f"{prefix}/{shard:05d}_stats.json", json.dumps(stats).encode())


def write_wids_gz_split(folder: str, split: str) -> str:
    """.tar.gz shards (png + json) and a wids shard index (relative URLs) listing them with their counts."""
    samples = digits_pil(split)
    os.makedirs(folder, exist_ok=True)
    shardlist = []
    for shard, first in enumerate(range(0, len(samples), 150)):
        name = f"part-{shard:03d}.tar.gz"
        chunk = samples[first : first + 150]
        with tarfile.open(os.path.join(folder, name), "w:gz") as tar:
            for i, (image, label) in enumerate(chunk):
                for ext, data in (("png", _png(image)), ("json", json.dumps({"label": label}).encode())):
                    info = tarfile.TarInfo(f"{first + i:07d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shardlist.append({"url": name, "nsamples": len(chunk)})
    index = os.path.join(folder, "digits-val.json")
    with open(index, "w") as f:
        json.dump({"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist}, f)
    return index


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def assert_trained(run: str, result, epochs: int) -> list[dict]:
    assert result.returncode == 0, result.stderr[-3000:]
    history = read_metrics(run)
    assert [m["epoch"] for m in history] == list(range(epochs))
    assert all(m["val_samples"] == 359 for m in history)  # every validation sample once
    best = load_checkpoint(f"{run}/checkpoints/best.pt")
    assert best["best_accuracy"] >= 0.6, best["history"]  # chance is 0.1
    return history


def test_train_on_webdataset_shardwriter_shards_without_manifest(tmp_path):
    data = str(tmp_path / "wds")
    write_shard_writer_split(f"{data}/train", "train")
    write_shard_writer_split(f"{data}/test", "test")
    run = str(tmp_path / "run")
    result = run_train(
        f"data.train_shards={data}/train",
        f"data.val_shards=['{data}/test/digits-test-{{000000..000000}}.tar']",  # a Hydra list of a pattern
        "data.num_classes=10",
        "epochs=4",
        # The replica in train.py, reading in its own process, eager (accelerator=cpu_eager):
        # the spawn, worker and XLA paths are test_e2e's; here they would only add seconds.
        "accelerator=cpu_eager",
        "accelerator.in_process=true",
        "data.num_workers=0",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    history = assert_trained(run, result, 4)
    assert all(m["train_samples"] == 1438 for m in history)
    assert os.path.exists(f"{data}/train/{INDEX_NAME}")  # counted once, at start, and saved
    assert "counts from counted now" in result.stdout + result.stderr  # Hydra logs the parent to stdout


def test_train_on_img2dataset_shards_in_a_bucket_with_bad_samples_and_a_wids_index(bucket, tmp_path):
    write_img2dataset_split(f"{bucket}/i2d/train", "train", bad_every=50)
    index = write_wids_gz_split(str(tmp_path / "val"), "test")
    run = f"{bucket}/runs/i2d"
    result = run_train(
        f"data.train_shards={bucket}/i2d/train",
        f"data.val_shards={index}",
        "data.num_classes=10",
        "data.image_size=32",
        "data.label_key=json:label",
        "data.index=never",  # every count is recorded: _stats.json and the wids index
        "data.max_bad_fraction=0.05",  # 2% of the training images are broken on purpose
        "epochs=4",
        # The replica in train.py, reading in its own process, eager (accelerator=cpu_eager):
        # the spawn, worker and XLA paths are test_e2e's; here they would only add seconds.
        "accelerator=cpu_eager",
        "accelerator.in_process=true",
        "data.num_workers=0",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    history = assert_trained(run, result, 4)
    bad = len(range(0, 1438, 50))
    assert all(m["train_samples"] == 1438 - bad for m in history)  # bad samples skipped and counted
    assert "cannot decode" in result.stderr
    assert not storage.exists(f"{bucket}/i2d/train/{INDEX_NAME}")
