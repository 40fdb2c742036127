"""Photo-like benchmark images: regions of scikit-learn's two sample photographs, resized.

Shared by bench.pipeline.imagenet_data (ImageNet's spread of sizes, grain,
odd kinds) and bench.feed.data (the GPU headline's ~465x360 JPEGs); standard
library, numpy and PIL only, so either imports it without the other's harness.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

# The share of the source photo's largest fitting region that an image shows.
REGION_SCALE = (0.5, 1.0)


@functools.cache
def source_photos() -> tuple[Image.Image, ...]:
    """china.jpg and flower.jpg (640x427), loaded once a process (forked generators inherit them)."""
    from sklearn.datasets import load_sample_images

    return tuple(Image.fromarray(pixels) for pixels in load_sample_images().images)


def photo_region(index: int, width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """A random region of source photo index % 2 with the image's aspect, resized to width x height.

    Three draws from rng, in this order: the region's scale, its left and top edges.
    """
    source = source_photos()[index % 2]
    scale = min(source.width / width, source.height / height) * rng.uniform(*REGION_SCALE)
    region_w, region_h = width * scale, height * scale
    left = rng.uniform(0.0, source.width - region_w)
    top = rng.uniform(0.0, source.height - region_h)
    return source.resize((width, height), Image.BICUBIC, box=(left, top, left + region_w, top + region_h))
