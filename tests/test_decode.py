"""Sample decoding: formats, shapes and the one-line reasons for rejecting a sample."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import png_bytes
from tpustream.data.decode import ImageDecoder, SampleError


def decoder(fmt: str = "png", size: int = 4) -> ImageDecoder:
    return ImageDecoder(fmt, 3, size, size, num_classes=10)


def test_png_jpg_and_raw_decode_to_chw_uint8():
    image = np.random.default_rng(0).integers(0, 256, (3, 4, 4), dtype=np.uint8)
    out, label = decoder("png")({"png": png_bytes(image), "cls": b"7"})
    assert out.dtype == np.uint8 and np.array_equal(out, image) and label == 7
    jpg = io.BytesIO()
    Image.fromarray(np.full((4, 4, 3), 128, np.uint8)).save(jpg, format="JPEG", quality=95)
    out, _ = decoder("jpg")({"jpeg": jpg.getvalue(), "cls": b"0"})
    assert out.shape == (3, 4, 4) and abs(int(out.mean()) - 128) <= 2
    out, _ = decoder("raw")({"raw": image.tobytes(), "cls": b"1"})
    assert np.array_equal(out, image)


def test_grayscale_and_rgba_pngs_become_rgb():
    gray = io.BytesIO()
    Image.fromarray(np.full((4, 4), 9, np.uint8)).save(gray, format="PNG")
    out, _ = decoder()({"png": gray.getvalue(), "cls": b"1"})
    assert out.shape == (3, 4, 4) and (out == 9).all()


@pytest.mark.parametrize(
    "sample, reason",
    [
        ({"png": b"not a png", "cls": b"1"}, "cannot decode png"),
        ({"png": png_bytes(np.zeros((3, 5, 4), np.uint8)), "cls": b"1"}, r"image shape \(3, 5, 4\) differs"),
        ({"cls": b"1", "txt": b"x"}, r"no png field \(fields: cls, txt\)"),
        ({"png": png_bytes(np.zeros((3, 4, 4), np.uint8))}, "missing label"),
        ({"png": png_bytes(np.zeros((3, 4, 4), np.uint8)), "cls": b"cat"}, "not an integer"),
        ({"png": png_bytes(np.zeros((3, 4, 4), np.uint8)), "cls": b"10"}, r"outside 0\.\.9"),
    ],
)
def test_bad_samples_name_the_reason(sample, reason):
    with pytest.raises(SampleError, match=reason):
        decoder()(sample)


def test_raw_with_wrong_length_is_rejected():
    with pytest.raises(SampleError, match="raw image has 5 bytes"):
        decoder("raw")({"raw": b"12345", "cls": b"1"})
