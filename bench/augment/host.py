"""bench.augment's host side: the ImageNet pipeline with and without the draws, host RandAugment's cost.

Everything here runs in the benchmark's own process with one torch thread
(bench.pipeline.harness.start_run), as each DataLoader worker would.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.augment.recipe import (
    AUGMENT_ON,
    AUGMENT_PARTS,
    RANDAUGMENT,
    TIMM_IMG_MEAN,
    TIMM_MAGNITUDE_MAX,
)
from bench.pipeline import harness
from bench.pipeline.harness import BATCH_SIZE, SEED
from bench.pipeline.imagenet_configs import EVAL_CROP_RATIO, SHUFFLE_BUFFER, ours
from bench.pipeline.imagenet_data import IMAGE_SIZE, BenchData
from tpustream.augment.draws import BatchDraws
from tpustream.config import AugmentConfig

FORMS = {"off": None, "on": AUGMENT_ON}  # ShardStream's augment= in each form
CHANNELS = 3


# ------------------------------------------------------------ the pipeline


def pipeline_rates(data: BenchData, rounds: int, min_seconds: float, warmup_batches: int) -> dict:
    """ours-local training w=0, augmentation off and on, alternating for `rounds` rounds.

    Each form's samples/s pools its rounds (samples over seconds); "on_over_off"
    is their ratio, 1.0 when the draws cost the host nothing.
    """
    rows: dict[str, list[dict]] = {form: [] for form in FORMS}
    for round_index in range(rounds):
        for form, augment in FORMS.items():
            build = functools.partial(ours, data, 0, True, "local", augment=augment)
            label = f"augment {form} (round {round_index + 1})"
            rows[form].append(harness.measure_row(label, build, min_seconds, warmup_batches))
    pooled = {form: pool(form_rows) for form, form_rows in rows.items()}
    return {
        **pooled,
        "on_over_off": pooled["on"]["samples_per_s"] / pooled["off"]["samples_per_s"],
        "rounds": rows,
    }


def pool(rows: list[dict]) -> dict:
    samples = sum(r["samples"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    foreign = sum(r["foreign_cores"] * r["seconds"] for r in rows) / seconds
    rates = [r["samples_per_s"] for r in rows]
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "rounds_min_max": [min(rates), max(rates)],  # this VM's pass-to-pass spread
        "foreign_cores": foreign,
    }


# ----------------------------------------------------------------- the crops


def take_crops(data: BenchData, count: int) -> dict[str, torch.Tensor]:
    """The first `count` training crops of our pipeline (epoch 0): uint8 (N, 3, 224, 224), labels, sample ids.

    Read from the ShardStream itself (no DataLoader), which keeps each batch's sample ids.
    """
    stream = harness.make_stream(
        data.splits["local"],
        0,
        SHUFFLE_BUFFER,
        True,
        train_crop="random_resized",
        eval_crop_ratio=EVAL_CROP_RATIO,
    )
    parts: dict[str, list[torch.Tensor]] = {"image": [], "label": [], "sample_id": []}
    taken = 0
    for batch in stream:
        for key, values in parts.items():
            values.append(batch[key])
        taken += len(batch["label"])
        if taken >= count:
            break
    if taken < count:
        raise ValueError(f"the data holds {taken} training crops, fewer than the {count} asked for")
    return {key: torch.cat(values)[:count] for key, values in parts.items()}


def save_device_batches(crops: dict[str, torch.Tensor], batch_size: int, count: int, path: Path) -> Path:
    """`count` batches of `batch_size` crops with their draws, as the stream adds them (group: the batch)."""
    if count * batch_size > len(crops["label"]):
        raise ValueError(
            f"{count} batches of {batch_size} need more than the {len(crops['label'])} crops taken"
        )
    draws = BatchDraws(AUGMENT_ON, (IMAGE_SIZE, IMAGE_SIZE), CHANNELS, batch_size, SEED)
    batches = []
    for index in range(count):
        part = slice(index * batch_size, (index + 1) * batch_size)
        sample_ids = crops["sample_id"][part].numpy()
        batches.append({"image": crops["image"][part], "label": crops["label"][part], **draws(0, sample_ids)})
    torch.save(batches, path)
    return path


# --------------------------------------------------------- per-image costs


def per_image_seconds(apply: Callable, items: Sequence, min_seconds: float) -> dict:
    """apply(item) on every item, in passes until min_seconds are measured, after an untimed pass over 16."""
    for item in items[:16]:
        apply(item)
    images, seconds = 0, 0.0
    with harness.ForeignCpu() as foreign:
        while seconds < min_seconds:
            start = time.perf_counter()
            for item in items:
                apply(item)
            seconds += time.perf_counter() - start
            images += len(items)
    return {
        "images": images,
        "seconds": seconds,
        "ms_per_image": 1000 * seconds / images,
        "images_per_s": images / seconds,
        "foreign_cores": foreign.cores,
    }


def draw_costs(min_seconds: float) -> dict[str, dict]:
    """BatchDraws' host time per image for batches of 128: everything on, and each part alone."""
    sample_ids = np.arange(BATCH_SIZE)
    costs = {}
    configs: dict[str, AugmentConfig] = {"all (on)": AUGMENT_ON, **AUGMENT_PARTS}
    for name, config in configs.items():
        draws = BatchDraws(config, (IMAGE_SIZE, IMAGE_SIZE), CHANNELS, BATCH_SIZE, SEED)
        # Epochs as items: every call draws anew, one batch of 128 per call.
        result = per_image_seconds(functools.partial(draws, sample_ids=sample_ids), range(64), min_seconds)
        costs[name] = per_batch_to_per_image(result)
    return costs


def per_batch_to_per_image(result: dict) -> dict:
    """per_image_seconds' figures where each item was a batch of BATCH_SIZE images."""
    images = result["images"] * BATCH_SIZE
    return {
        **result,
        "images": images,
        "ms_per_image": 1000 * result["seconds"] / images,
        "images_per_s": images / result["seconds"],
    }


def host_transforms() -> dict[str, tuple[str, Callable]]:
    """Name -> (input kind, transform): the libraries' host RandAugment and TrivialAugment."""
    from timm.data.auto_augment import rand_augment_transform
    from torchvision.transforms import v2

    return {
        "torchvision v2.RandAugment()": ("tensor", v2.RandAugment()),
        "torchvision v2.TrivialAugmentWide()": ("tensor", v2.TrivialAugmentWide()),
        f'timm rand_augment_transform("{RANDAUGMENT}")': (
            "pil",
            rand_augment_transform(
                RANDAUGMENT, {"img_mean": TIMM_IMG_MEAN, "magnitude_max": TIMM_MAGNITUDE_MAX}
            ),
        ),
    }


def host_transform_costs(crops: torch.Tensor, min_seconds: float) -> dict[str, dict]:
    """Each library transform on the same uint8 crops, one image at a time, as a per-sample stage applies it.

    torchvision's on (3, 224, 224) uint8 tensors; timm's on 224x224 RGB PIL
    images (the conversion to PIL made before timing, not counted).
    """
    inputs = {
        "tensor": list(crops),
        "pil": [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in crops],
    }
    torch.manual_seed(SEED)  # torchvision draws with torch's generator, timm with random's
    random.seed(SEED)
    costs = {}
    for name, (kind, transform) in host_transforms().items():
        print(f"  {name:<52}", end="", flush=True)
        costs[name] = {"input": kind, **per_image_seconds(transform, inputs[kind], min_seconds)}
        cost = costs[name]
        print(
            f"{cost['ms_per_image']:7.2f} ms/image  (other load {cost['foreign_cores']:.2f} cores)",
            flush=True,
        )
    return costs


def implied_rate(images_per_s: float, ms_per_image: float) -> float:
    """The pipeline's images/s (one core) with a per-image host cost added to each image."""
    return 1.0 / (1.0 / images_per_s + ms_per_image / 1000)
