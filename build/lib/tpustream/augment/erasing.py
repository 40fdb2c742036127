"""Random erasing on the device: each sample's rectangles as masks over the normalised image.

timm's RandomErasing (timm/data/random_erasing.py) fills after normalisation:
``const`` with 0 (the mean colour), ``rand`` with one standard-normal value per
channel, ``pixel`` with standard-normal noise per pixel. The rectangles and
colours are drawn on the host (``draws``); per-pixel noise would be an image
per sample on the host-to-device link, so the host sends a 32-bit key per
sample and the device hashes (key, pixel) into noise: a counter-based
generator, the same on any device and in any graph. An empty rectangle
erases nothing, so every sample takes the same graph.
"""

from __future__ import annotations

import math

import torch

from tpustream.augment.mixing import box_mask

# murmur3's 32-bit finaliser and the golden-ratio increment, as int32 (two's complement wraps).
GOLDEN = 0x9E3779B9 - (1 << 32)
FMIX = (0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32))


def _shift(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 (>> is arithmetic on signed integers)."""
    return (values >> bits) & ((1 << (32 - bits)) - 1)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shift(h, 16)
    h = h * FMIX[0]
    h = h ^ _shift(h, 13)
    h = h * FMIX[1]
    return h ^ _shift(h, 16)


def _uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[0, 1) with 24 random bits from hash(key, counter)."""
    return _shift(_fmix32(keys ^ _fmix32(counters * GOLDEN)), 8).float() * (1.0 / (1 << 24))


def pixel_noise(keys: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, H, W) standard normals from each sample's key (B,) int32 and the pixel index (Box-Muller)."""
    pixels = torch.arange(math.prod(shape), dtype=torch.int32, device=keys.device).view(1, *shape)
    keys = keys.to(torch.int32).view(-1, 1, 1, 1)
    radius = torch.sqrt(-2.0 * torch.log1p(-_uniform(keys, 2 * pixels)))
    return radius * torch.cos((2 * math.pi) * _uniform(keys, 2 * pixels + 1))


def erase(
    images: torch.Tensor, boxes: torch.Tensor, values: torch.Tensor, noise_keys: torch.Tensor | None = None
) -> torch.Tensor:
    """images (B, C, H, W) normalised, boxes (B, K, 4), values (B, K, C); later rectangles over earlier.

    noise_keys (B,): fill with per-pixel noise instead of the values (timm's "pixel" mode).
    """
    height, width = images.shape[-2:]
    noise = pixel_noise(noise_keys, images.shape[1:]).to(images.dtype) if noise_keys is not None else None
    for k in range(boxes.shape[1]):
        inside = box_mask(boxes[:, k], height, width)
        fill = noise if noise is not None else values[:, k].view(*values.shape[:1], -1, 1, 1).to(images.dtype)
        images = torch.where(inside, fill, images)
    return images
