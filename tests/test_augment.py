"""Batch-level crop/flip against the torchvision transforms they replace."""

from __future__ import annotations

import numpy as np

from tpustream.data.read.crop_flip import random_crop_flip


def test_each_output_is_a_window_of_the_padded_image_possibly_mirrored():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 3, 6, 5), dtype=np.uint8)
    out = random_crop_flip(images, padding=2, flip=True, rng=np.random.default_rng(1))
    assert out.shape == images.shape and out.dtype == np.uint8
    padded = np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2)))
    offsets, mirrored = set(), 0
    for i in range(len(images)):
        matches = [
            (top, left, flip)
            for top in range(5)
            for left in range(5)
            for flip in (False, True)
            if np.array_equal(
                out[i],
                padded[i, :, top : top + 6, left : left + 5][..., ::-1]
                if flip
                else padded[i, :, top : top + 6, left : left + 5],
            )
        ]
        assert matches, f"image {i} is not a crop of its padded input"
        offsets.add(matches[0][:2])
        mirrored += matches[0][2]
    assert len(offsets) > 10  # offsets are drawn per image, not per batch
    assert 10 < mirrored < 54


def test_no_padding_no_flip_is_identity_and_input_is_untouched():
    images = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    before = images.copy()
    out = random_crop_flip(images, padding=0, flip=False, rng=np.random.default_rng(0))
    assert np.array_equal(out, images) and out is not images
    random_crop_flip(images, padding=3, flip=True, rng=np.random.default_rng(0))
    assert np.array_equal(images, before)
