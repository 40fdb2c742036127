"""The device-side normaliser against torchvision's ToTensor + Normalize."""

from __future__ import annotations

import numpy as np
import torch
import torchvision.transforms.functional as TF

from tpustream.training.normalize import Normalizer


def test_normalizer_matches_to_tensor_then_normalize():
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 5, 5), dtype=np.uint8)
    mean, std = [0.49, 0.48, 0.45], [0.25, 0.24, 0.26]
    expected = torch.stack([TF.normalize(torch.from_numpy(im).float() / 255, mean, std) for im in images])
    torch.testing.assert_close(
        Normalizer(mean, std)(torch.from_numpy(images)), expected, rtol=1e-5, atol=1e-5
    )
