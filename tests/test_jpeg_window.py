"""data.format.jpeg_window: one window of a JPEG decoded alone, exactly as the whole image cut."""

from __future__ import annotations

import logging
import random
import re

import numpy as np
import pytest
import simplejpeg

from tests.conftest import encode_image
from tpustream.data.format import jpeg_window
from tpustream.data.format.decode import SampleError
from tpustream.data.read.crops import CropPlan, SampleRandom, center_plan, decode_crop, random_resized_plan

needs_decoder = pytest.mark.skipif(
    jpeg_window.window_decoder() is None, reason="no window decoder here (no C compiler or libjpeg-turbo)"
)


@pytest.fixture(scope="module")
def jpegs(photo) -> dict[str, bytes]:
    """The photograph as JPEG in the variants a dataset holds (sizes not multiples of an iMCU)."""
    big = photo.resize((1001, 667))
    return {
        "4:2:0": encode_image(photo, quality=95),
        "4:4:4": encode_image(photo.crop((3, 5, 600, 400)), quality=90, subsampling=0),
        "4:2:2": encode_image(photo.crop((0, 0, 517, 333)), quality=85, subsampling=1),
        "grey": encode_image(photo.convert("L").crop((1, 1, 555, 401))),
        "progressive": encode_image(big, quality=90, progressive=True),
        "restarts": encode_image(big, quality=80, restart_marker_rows=1),
    }


def whole_then_cut(data: bytes, factor: int, grey: bool, box: tuple[int, int, int, int]) -> np.ndarray:
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    pixels = simplejpeg.decode_jpeg(
        data,
        colorspace="GRAY" if grey else "RGB",
        min_height=-(-height // factor),
        min_width=-(-width // factor),
        min_factor=factor,
    )
    left, top, right, bottom = box
    return pixels[top:bottom, left:right]


@needs_decoder
@pytest.mark.parametrize("kind", ["4:2:0", "4:4:4", "4:2:2", "grey", "progressive", "restarts"])
def test_a_window_is_the_whole_image_decoded_and_cut_pixel_for_pixel(jpegs, kind):
    decode = jpeg_window.window_decoder()
    data = jpegs[kind]
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    rng = random.Random(kind)
    for factor in (1, 2, 4, 8):
        scaled_h, scaled_w = -(-height // factor), -(-width // factor)
        for grey in (False, True):
            # Edges of the image, one-pixel windows, and windows starting on and off iMCU boundaries.
            corner = (scaled_w - 1, scaled_h - 1, scaled_w, scaled_h)
            boxes = [(0, 0, scaled_w, scaled_h), corner, (16, 8, 17, 9)]
            for _ in range(6):
                w, h = rng.randint(1, scaled_w), rng.randint(1, scaled_h)
                left, top = rng.randint(0, scaled_w - w), rng.randint(0, scaled_h - h)
                boxes.append((left, top, left + w, top + h))
            for box in boxes:
                if box[2] > scaled_w or box[3] > scaled_h:
                    continue
                expected = whole_then_cut(data, factor, grey, box)
                assert np.array_equal(decode(data, factor, grey, *box), expected), (factor, grey, box)


@needs_decoder
def test_training_crops_are_the_same_through_the_window(jpegs):
    for index, data in enumerate([jpegs["4:2:0"], jpegs["progressive"], jpegs["grey"]] * 8):
        for channels in (3, 1):

            def plan(h, w, index=index):
                return random_resized_plan(h, w, 224, SampleRandom(3, 0, index), True)

            windowed = decode_crop(data, plan, 224, channels)
            assert np.array_equal(windowed, decode_crop(data, plan, 224, channels, window=False))
    # Evaluation's plan takes the whole image: it is decoded whole either way.
    assert np.array_equal(
        decode_crop(jpegs["4:2:0"], lambda h, w: center_plan(h, w, 224, 0.875), 224, 3),
        decode_crop(jpegs["4:2:0"], lambda h, w: center_plan(h, w, 224, 0.875), 224, 3, window=False),
    )


@needs_decoder
def test_bad_data_is_refused_with_libjpegs_reason_and_crops_judge_it_as_before(jpegs):
    decode = jpeg_window.window_decoder()
    data = jpegs["4:2:0"]
    with pytest.raises(ValueError, match="Not a JPEG file"):
        decode(b"garbage" * 20, 1, False, 0, 0, 4, 4)
    with pytest.raises(ValueError, match=r"window \[0, 700\) x \[0, 4\) outside the 640x427 image"):
        decode(data, 1, False, 0, 0, 700, 4)
    with pytest.raises(ValueError, match="Premature end of JPEG file"):  # the window runs past the cut
        decode(data[: len(data) // 2], 1, False, 0, 0, 640, 427)
    # A JPEG cut short is refused whatever its window: the window decoder alone would
    # read the rows above the cut, so such a JPEG goes to the whole-image decode, which refuses it.
    cut = data[: len(data) // 2]
    assert np.array_equal(
        decode(cut, 1, False, 0, 0, 100, 50), whole_then_cut(data, 1, False, (0, 0, 100, 50))
    )

    def top_corner(h, w):
        return CropPlan((0, 0, 100, 50), (64, 64))

    for window in (True, False):
        with pytest.raises(SampleError, match="cannot decode image"):
            decode_crop(cut, top_corner, 64, 3, window=window)


def test_without_a_compiler_images_are_decoded_whole_and_the_reason_logged(
    monkeypatch, jpegs, caplog, tmp_path
):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    jpeg_window.forget_decoder()
    try:
        with caplog.at_level(logging.WARNING, logger="tpustream.data.format.jpeg_window"):
            assert jpeg_window.window_decoder() is None
        assert "cropped JPEG decoding unavailable (no C compiler" in caplog.text
        assert "decoding whole images" in caplog.text

        def plan(h, w):
            return random_resized_plan(h, w, 224, SampleRandom(1, 0, 0), True)

        assert decode_crop(jpegs["4:2:0"], plan, 224, 3).shape == (3, 224, 224)
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        jpeg_window.forget_decoder()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpustream.data.format.jpeg_window"):
            assert jpeg_window.window_decoder() is None
        assert re.search(r"unavailable \(OSError: \S*/false failed \(no output\)\)", caplog.text)
        monkeypatch.setenv(jpeg_window.ENV_SWITCH, "0")
        jpeg_window.forget_decoder()
        with caplog.at_level(logging.INFO, logger="tpustream.data.format.jpeg_window"):
            assert jpeg_window.window_decoder() is None
        assert "cropped JPEG decoding off (TPUSTREAM_JPEG_WINDOW=0)" in caplog.text
    finally:
        monkeypatch.undo()
        jpeg_window.forget_decoder()


@needs_decoder
def test_a_build_is_made_once_and_found_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    library, compiler = jpeg_window.find_libjpeg(), "cc"
    built = jpeg_window.build(library, compiler)
    assert built.parent == tmp_path / "tpustream" and built.name.startswith("jpeg_window-")
    stamp = built.stat().st_mtime_ns
    assert jpeg_window.build(library, compiler) == built and built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no partial file left


@needs_decoder
def test_any_buffer_of_bytes_is_read_in_place(jpegs):
    decode = jpeg_window.window_decoder()
    data = jpegs["4:2:0"]
    expected = decode(data, 2, False, 10, 20, 110, 70)
    for buffer in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert np.array_equal(decode(buffer, 2, False, 10, 20, 110, 70), expected)


@needs_decoder
def test_an_unwritable_cache_falls_back_to_the_temporary_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    built = jpeg_window.build(jpeg_window.find_libjpeg(), "cc")
    assert built.parent == jpeg_window._cache_folders()[1] and built.exists()
