"""End to end, ImageNet's way: variable-size JPEGs -> shards of the original bytes -> random-resized crops.

The images are ImageNet-shaped in what matters to the pipeline (every one
another size, JPEG at varying quality, a CMYK and a grayscale JPEG and a PNG
named .JPEG among them), small enough to train on the XLA CPU device in
seconds. A class is a colour and a stripe orientation, which survive any
crop and flip, so a small CNN learns them far above chance in a few epochs.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import run_train
from tpustream.checkpoint import load_checkpoint, read_metrics
from tpustream.data.resolve.split import load_manifest
from tpustream.data.write.command import main as make_shards_main

pytestmark = pytest.mark.slow

COLOURS = [(200, 40, 40), (40, 160, 40), (40, 60, 200), (200, 180, 30), (150, 40, 170)]
NUM_CLASSES = 2 * len(COLOURS)


def striped_image(label: int, rng: np.random.Generator) -> Image.Image:
    """A noisy image of random size in the label's colour, striped horizontally (label < 5) or vertically."""
    height, width = (int(v) for v in rng.integers(48, 161, 2))
    period = int(rng.integers(6, 12))
    rows = np.arange(height)[:, None] if label < len(COLOURS) else np.arange(width)[None, :]
    stripes = ((rows // (period // 2)) % 2).astype(np.float32)
    colour = np.array(COLOURS[label % len(COLOURS)], np.float32)
    pixels = colour * (0.55 + 0.45 * stripes[..., None]) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_image_folder(root, split: str, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % NUM_CLASSES
        folder = root / split / f"n{label:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        image = striped_image(label, rng)
        out = io.BytesIO()
        if i == 3:
            image.convert("CMYK").save(out, "JPEG", quality=90)  # as 22 of ImageNet's train files
        elif i == 4:
            image.convert("L").save(out, "JPEG", quality=90)
        elif i == 5:
            image.save(out, "PNG")  # a PNG named .JPEG, as one of ImageNet's
        else:
            image.save(out, "JPEG", quality=int(rng.integers(85, 97)))
        (folder / f"img_{i:05d}.JPEG").write_bytes(out.getvalue())


def recipe(shards: str, run: str, epochs: int) -> list[str]:
    """train.py's overrides for a small CNN on the shards at 64 px, learning in a few epochs."""
    return [
        "data=imagenet",
        f"data.root={shards}",
        "data.image_size=64",
        "accelerator.in_process=true",  # the spawn path is test_e2e's; here it would only add seconds
        "model=small_cnn",
        "batch_size=32",
        f"epochs={epochs}",
        "optim.lr=0.1",
        "optim.reference_batch_size=null",
        "optim.warmup_epochs=0.5",
        "optim.label_smoothing=0.0",
        f"output_dir={run}",
    ]


@pytest.fixture(scope="module")
def imagenet_shards(tmp_path_factory) -> str:
    """400 training and 100 validation images of the ten classes, as shards of 100 by tpustream-shards."""
    tmp_path = tmp_path_factory.mktemp("imagenet")
    source = tmp_path / "imagenet"
    write_image_folder(source, "train", 400, seed=0)
    write_image_folder(source, "val", 100, seed=1)
    shards = str(tmp_path / "shards")
    command = ["imagefolder", shards, "--source", str(source), "--no-progress", "--workers", "1"]
    assert make_shards_main([*command, "--samples-per-shard", "100"]) == 0
    return shards


def test_variable_size_jpegs_to_shards_to_random_resized_training(imagenet_shards, tmp_path):
    shards = imagenet_shards
    train = load_manifest(f"{shards}/train")
    assert train.image_size is None and train.num_samples == 400  # sizes vary; recorded as such

    run = str(tmp_path / "run")
    epochs = 5
    result = run_train(*recipe(shards, run, epochs), "data.num_workers=0")
    assert result.returncode == 0, result.stderr[-3000:]
    history = read_metrics(run)
    assert [m["epoch"] for m in history] == list(range(epochs))
    assert all(m["val_samples"] == 100 for m in history)
    # One train and one eval graph (plus the initial buffers), compiled in
    # epoch 0 and never again, though every image has another size.
    assert history[0]["compilations"] <= 3
    assert {m["compilations"] for m in history} == {history[0]["compilations"]}
    best = load_checkpoint(f"{run}/checkpoints/best.pt")
    assert best["best_accuracy"] >= 0.8, best["history"]  # chance is 0.1


def test_jpegs_decoded_on_the_device_train_the_same_recipe(imagenet_shards, tmp_path):
    """data.decode=device on the native runtime (here the CPU): workers send JPEGs, the replica decodes."""
    run = str(tmp_path / "run")
    epochs = 3
    overrides = ["data.decode=device", "data.num_workers=2", "accelerator=cpu_eager"]
    result = run_train(*recipe(imagenet_shards, run, epochs), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    history = read_metrics(run)
    assert [m["epoch"] for m in history] == list(range(epochs))
    assert all(m["val_samples"] == 100 and m["train_filled"] == 0 for m in history)
    assert history[-1]["val_accuracy"] >= 0.5, history  # chance is 0.1
