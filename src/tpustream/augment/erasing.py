"""Random erasing on the device: each sample's rectangles as masks over the normalised image.

timm's RandomErasing (timm/data/random_erasing.py) fills after normalisation:
``const`` with 0 (the mean colour), ``rand`` with one standard-normal value per
channel. The rectangles and colours are drawn on the host (``draws``); an
empty rectangle erases nothing, so every sample takes the same graph.
"""

from __future__ import annotations

import torch

from tpustream.augment.mixing import box_mask


def erase(images: torch.Tensor, boxes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """images (B, C, H, W) normalised, boxes (B, K, 4), values (B, K, C); later rectangles over earlier."""
    height, width = images.shape[-2:]
    for k in range(boxes.shape[1]):
        inside = box_mask(boxes[:, k], height, width)
        images = torch.where(inside, values[:, k].view(*values.shape[:1], -1, 1, 1).to(images.dtype), images)
    return images
