"""The device-side first layer of every model: uint8 images to normalised float32."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Normalizer:
    """uint8 images to float32 (x / 255 - mean) / std per channel, as one multiply-add.

    The trainer applies it on the device, inside the compiled step: batches
    then cross process boundaries and the host-to-device link as uint8, a
    quarter of the bytes of float32.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device | str = "cpu"):
        if len(mean) != len(std):
            raise ValueError("mean and std need one value per channel")
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.scale = (1.0 / (255.0 * std_t)).to(device)
        self.bias = (-mean_t / std_t).to(device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, images.float(), self.scale)
