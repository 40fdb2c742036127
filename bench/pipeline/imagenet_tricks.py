"""The ImageNet-like benchmark's side measurements: DCT scaling's share, each choice's gain, host normalising.

DCT share: for every image, whether the crop L_ours draws for it (training,
epoch 0; and the evaluation crop) is shrunk enough for a 1/2, 1/4 or 1/8 DCT
scale (CropPlan.dct_factor in tpustream.data.read.crops); PNGs never are.

What each choice buys ("tricks"): on the first 1,024 colour and grey JPEG
photos in memory, with their training crops (epoch 0), one core, each
variant against its alternative: TurboJPEG (simplejpeg) against PIL decoding
to a numpy array; torch's uint8 antialiasing resample of the crop against
PIL's bilinear resize of the same box; tpustream.data.read.crops.decode_crop with
DCT-domain scaling on and off, over all crops and over only those it
applies to. The variants run interleaved, 5 rounds (quick: 3), and report
their median: rows measured one after the other drift by as much as these
differences on a shared machine.

Normalisation: what tpustream's Normalizer would cost an image on the host
(best of 6 on a random uint8 batch) is printed with what ours-local train
w=0 would reach if it paid that too.
"""

from __future__ import annotations

import io
import math
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import simplejpeg
import torch
from PIL import Image

from bench.pipeline.harness import BATCH_SIZE, SEED
from bench.pipeline.imagenet_configs import EVAL_CROP_RATIO, MEAN, MODES, STD
from bench.pipeline.imagenet_data import IMAGE_SIZE, BenchData
from tpustream.data.read.crops import SampleRandom, center_plan, decode_crop, random_resized_plan
from tpustream.training.normalize import Normalizer

TRICK_IMAGES = 1024  # JPEG photos the trick comparison runs over


def normalize_seconds_per_image() -> float:
    """Seconds an image tpustream's Normalizer takes on the host: best of 6 on a uint8 batch."""
    normalize = Normalizer(MEAN, STD)
    batch = torch.randint(0, 256, (BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
    best = math.inf
    for _ in range(6):
        started = time.perf_counter()
        normalize(batch)
        best = min(best, time.perf_counter() - started)
    return best / BATCH_SIZE


def dct_shares(data: BenchData) -> dict:
    """Per mode, how many images' crops (as L_ours draws them) each DCT scale factor decodes at."""
    shares = {}
    for mode in MODES:
        factors: Counter = Counter()
        for index, photo in enumerate(data.photos):
            if photo.kind == "png":
                factors["not JPEG"] += 1
                continue
            if mode == "train":
                rnd = SampleRandom(SEED, 0, index)
                plan = random_resized_plan(photo.height, photo.width, IMAGE_SIZE, rnd, True)
            else:
                plan = center_plan(photo.height, photo.width, IMAGE_SIZE, EVAL_CROP_RATIO)
            factors[f"1/{plan.dct_factor()}"] += 1
        scaled = sum(n for factor, n in factors.items() if factor in ("1/2", "1/4", "1/8"))
        order = ["1/1", "1/2", "1/4", "1/8", "not JPEG"]
        images_per_factor = {factor: factors[factor] for factor in order if factor in factors}
        shares[mode] = {"share_scaled": scaled / len(data.photos), "images_per_factor": images_per_factor}
    return shares


def measure_tricks(data: BenchData, rounds: int) -> list[dict]:
    """What each of ours' choices buys, one against its alternative on the same images, one core.

    The JPEG photos' training crops (epoch 0), in memory; every variant runs
    over all of them once per round, the variants interleaved, and each
    reports the median of its rounds: on a shared machine, a row measured
    alone can be off by 15% from one minute to the next, which is as much as
    the differences measured here.
    """
    photos = [p for p in data.photos if p.kind in ("rgb", "gray")][:TRICK_IMAGES]
    plans = [
        random_resized_plan(p.height, p.width, IMAGE_SIZE, SampleRandom(SEED, 0, i), True)
        for i, p in enumerate(photos)
    ]
    scaled = [(p, plan) for p, plan in zip(photos, plans, strict=True) if plan.dct_factor() > 1]
    pixels = [simplejpeg.decode_jpeg(p.data) for p in photos]  # untimed inputs of the resample variants
    pil_images = [Image.fromarray(px) for px in pixels]
    size = (IMAGE_SIZE, IMAGE_SIZE)

    def torch_resample() -> None:
        for px, plan in zip(pixels, plans, strict=True):
            left, top, right, bottom = plan.region
            region = torch.from_numpy(px[top:bottom, left:right]).permute(2, 0, 1)[None]
            torch.nn.functional.interpolate(region, size=size, mode="bilinear", antialias=True)

    def crops(items: list, use_dct: bool) -> Callable[[], None]:
        def run() -> None:
            for photo, plan in items:
                decode_crop(photo.data, lambda h, w, plan=plan: plan, IMAGE_SIZE, 3, use_dct)

        return run

    pairs = list(zip(photos, plans, strict=True))
    variants = {
        "decode: TurboJPEG (simplejpeg)": (
            len(photos),
            lambda: [simplejpeg.decode_jpeg(p.data) for p in photos],
        ),
        "decode: PIL + numpy": (
            len(photos),
            lambda: [np.asarray(Image.open(io.BytesIO(p.data)).convert("RGB")) for p in photos],
        ),
        "resample crop: torch uint8 antialias": (len(photos), torch_resample),
        "resample crop: PIL bilinear (box)": (
            len(photos),
            lambda: [
                im.resize(size, Image.BILINEAR, box=plan.region)
                for im, plan in zip(pil_images, plans, strict=True)
            ],
        ),
        "ours' crop, DCT scaling on": (len(pairs), crops(pairs, True)),
        "ours' crop, DCT scaling off": (len(pairs), crops(pairs, False)),
        "ours' crop, DCT on, scaled images only": (len(scaled), crops(scaled, True)),
        "ours' crop, DCT off, scaled images only": (len(scaled), crops(scaled, False)),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (_, run) in variants.items():
            if variants[name][0] == 0:
                continue
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    rows = []
    for name, (count, _) in variants.items():
        if count:
            rates = sorted(count / t for t in seconds[name])
            rows.append({"variant": name, "images": count, "median": rates[len(rates) // 2], "rates": rates})
    return rows


def trick_ratios(rows: list[dict]) -> list[tuple[str, float]]:
    median = {r["variant"]: r["median"] for r in rows}
    pairs = [
        ("TurboJPEG / PIL decode", "decode: TurboJPEG (simplejpeg)", "decode: PIL + numpy"),
        ("torch / PIL resample", "resample crop: torch uint8 antialias", "resample crop: PIL bilinear (box)"),
        ("DCT scaling on / off, all crops", "ours' crop, DCT scaling on", "ours' crop, DCT scaling off"),
        (
            "DCT scaling on / off, the crops it applies to",
            "ours' crop, DCT on, scaled images only",
            "ours' crop, DCT off, scaled images only",
        ),
    ]
    return [
        (text, median[top] / median[bottom])
        for text, top, bottom in pairs
        if top in median and bottom in median
    ]


def format_tricks(rows: list[dict]) -> str:
    width = max(len(r["variant"]) for r in rows)
    lines = [f"  {'variant':<{width}}  images  median/s  (min-max over rounds)"]
    for r in rows:
        spread = f"({r['rates'][0]:.0f}-{r['rates'][-1]:.0f})"
        lines.append(f"  {r['variant']:<{width}}  {r['images']:>6}  {r['median']:>8.0f}  {spread}")
    lines += [f"  {text}: {value:.2f}x" for text, value in trick_ratios(rows)]
    return "\n".join(lines)
