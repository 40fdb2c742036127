"""Sample decoding: every image format and mode, label and image keys, and one-line rejections."""

from __future__ import annotations

import io
import json
import pickle
import struct
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO, numbered_samples, png_bytes
from tpustream.data.format.decode import (
    DEFAULT_IMAGE_KEYS,
    ImageDecoder,
    SampleError,
    check_image_key,
    check_label,
    check_label_key,
    read_image_shape,
)
from tpustream.errors import ConfigError

HEIGHT, WIDTH = 5, 6  # not square: a transposed image fails the shape check
ORANGE = (200, 100, 50)
ORANGE_LUMA = 124  # ITU-R 601: 0.299 * 200 + 0.587 * 100 + 0.114 * 50 = 124.2

# Field -> (PIL format name, save options). PIL writes PGM and PBM through its
# PPM plugin, choosing the variant from the image mode (L, 1).
FORMATS = {
    "jpg": ("JPEG", {"quality": 95}),
    "jpeg": ("JPEG", {"quality": 95}),
    "png": ("PNG", {}),
    "ppm": ("PPM", {}),
    "pgm": ("PPM", {}),
    "pbm": ("PPM", {}),
    # exact: keep the colour of fully transparent pixels (libwebp zeroes it by default).
    "webp": ("WEBP", {"lossless": True, "exact": True}),
    "bmp": ("BMP", {}),
    "tif": ("TIFF", {}),
    "tiff": ("TIFF", {}),
}


def encode(image: Image.Image, field: str, **options) -> bytes:
    fmt, defaults = FORMATS[field]
    out = io.BytesIO()
    image.save(out, format=fmt, **{**defaults, **options})
    return out.getvalue()


def decoder(channels: int = 3, height: int = HEIGHT, width: int = WIDTH, **keys) -> ImageDecoder:
    return ImageDecoder(channels, height, width, num_classes=10, **keys)


def solid(mode: str, value) -> Image.Image:
    return Image.new(mode, (WIDTH, HEIGHT), value)


def decode(field: str, data: bytes, channels: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. PIL's warning on palette transparency
        out, label = decoder(channels, image_key=field)({field: data, "cls": b"3"})
    assert out.dtype == np.uint8 and out.shape == (channels, HEIGHT, WIDTH) and label == 3
    return out


def reference(data: bytes, channels: int) -> np.ndarray:
    """PIL's own decode and convert, as (C, H, W)."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB" if channels == 3 else "L"))
    return pixels.transpose(2, 0, 1) if pixels.ndim == 3 else pixels[None]


def noise(mode: str) -> Image.Image:
    rng = np.random.default_rng(0)
    if mode == "1":
        return Image.fromarray(rng.integers(0, 2, (HEIGHT, WIDTH), dtype=np.uint8) * 255).convert("1")
    bands = len(mode)
    pixels = rng.integers(0, 256, (HEIGHT, WIDTH, bands) if bands > 1 else (HEIGHT, WIDTH), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("field", sorted(FORMATS))
def test_every_format_decodes_like_pil(field, channels):
    mode = {"pgm": "L", "pbm": "1"}.get(field, "RGB")
    data = encode(noise(mode), field)
    out = decode(field, data, channels)
    # libjpeg's grey is the stored Y plane and libpng's its own rounding of the
    # luma, not luma recomputed from decoded RGB as PIL's convert("L") does.
    tolerance = {"jpg": 8, "jpeg": 8, "png": 1}.get(field, 0) if channels == 1 else 0
    assert np.abs(out.astype(int) - reference(data, channels)).max() <= tolerance


def test_raw_is_planar_bytes_of_the_shape():
    image = np.random.default_rng(0).integers(0, 256, (3, HEIGHT, WIDTH), dtype=np.uint8)
    assert np.array_equal(decode("raw", image.tobytes(), 3), image)
    with pytest.raises(SampleError, match=r"raw image has 5 bytes, shape \(3, 5, 6\) needs 90"):
        decoder()({"raw": b"12345", "cls": b"1"})


def palette_image(transparency) -> Image.Image:
    image = Image.new("P", (WIDTH, HEIGHT), 0)
    image.putpalette([*ORANGE, 10, 20, 30] + [0] * (3 * 254))
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


# (source image, fields it is written as, expected grey, expected RGB)
MODE_CASES = {
    "grey": (solid("L", 9), ("png", "jpg", "pgm", "bmp", "tiff", "webp"), 9, (9, 9, 9)),
    "rgb": (solid("RGB", ORANGE), ("png", "jpg", "ppm", "bmp", "tiff", "webp"), ORANGE_LUMA, ORANGE),
    "palette": (palette_image(None), ("png", "bmp", "tiff"), ORANGE_LUMA, ORANGE),
    "palette, index transparent": (palette_image(0), ("png",), ORANGE_LUMA, ORANGE),
    # tRNS with an alpha per palette entry: PIL warns if converted without RGBA.
    "palette, alpha table": (palette_image(b"\x00\x80"), ("png",), ORANGE_LUMA, ORANGE),
    # Alpha is dropped, not blended onto a background, as PIL's convert does.
    "rgba, transparent": (solid("RGBA", (*ORANGE, 0)), ("png", "tiff", "webp"), ORANGE_LUMA, ORANGE),
    "la, transparent": (solid("LA", (77, 0)), ("png", "tiff"), 77, (77, 77, 77)),
    "cmyk": (solid("RGB", ORANGE).convert("CMYK"), ("jpg", "tiff"), ORANGE_LUMA, ORANGE),
}


# A field name of no known format goes to PIL, which finds the format itself:
# "png as image" runs each PNG case through our PIL conversion too.
PIL_PNG = "png as image"


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    "case, field",
    [
        (case, field)
        for case, (_, fields, _, _) in MODE_CASES.items()
        for field in fields + ((PIL_PNG,) if "png" in fields else ())
    ],
)
def test_modes_convert_to_grey_or_rgb(case, field, channels):
    image, _, grey, rgb = MODE_CASES[case]
    data = encode(image, "png" if field == PIL_PNG else field)
    out = decode("image" if field == PIL_PNG else field, data, channels)
    expected = np.array([grey] if channels == 1 else rgb).reshape(channels, 1, 1)
    tolerance = 2 if field in ("jpg", "jpeg") else 0  # lossy even for a solid colour
    assert np.abs(out.astype(int) - expected).max() <= tolerance, (out[:, 0, 0], expected.ravel())


def test_bilevel_becomes_0_and_255():
    image = noise("1")
    ones = np.asarray(image)
    for field in ("png", "pbm", "bmp", "tiff"):
        for channels in (1, 3):
            out = decode(field, encode(image, field), channels)
            assert np.array_equal(out, np.broadcast_to(np.where(ones, 255, 0), out.shape))


SIXTEEN_BIT = np.array([[0, 255, 32767, 32768, 65280, 65535]] * HEIGHT, np.uint16)
SIXTEEN_BIT_AS_8 = np.array([0, 1, 127, 128, 254, 255], np.uint8)  # round(v / 257)


def sixteen_bit_bytes(field: str, mode: str) -> bytes:
    if mode == "I;16B":
        image = Image.frombytes("I;16B", (WIDTH, HEIGHT), SIXTEEN_BIT.astype(">u2").tobytes())
    elif mode == "I":
        image = Image.fromarray(SIXTEEN_BIT.astype(np.int32))
    else:
        image = Image.fromarray(SIXTEEN_BIT)
    data = encode(image, field)
    assert Image.open(io.BytesIO(data)).mode == {"pgm": "I"}.get(field, mode)
    return data


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("field, mode", [("png", "I;16"), ("tiff", "I;16"), ("tiff", "I;16B"), ("pgm", "I")])
def test_sixteen_bit_grey_is_scaled_not_clipped(field, mode, channels):
    # png goes through torchvision (a uint16 tensor), the others through PIL.
    out = decode(field, sixteen_bit_bytes(field, mode), channels)
    assert np.array_equal(out, np.broadcast_to(SIXTEEN_BIT_AS_8, out.shape))


def test_float_images_use_pils_0_to_255_scale():
    pixels = np.full((HEIGHT, WIDTH), 100.7, np.float32)
    pixels[0, :3] = (-5.0, 300.0, np.nan)
    out = decode("tiff", encode(Image.fromarray(pixels), "tiff"), 1)
    assert out[0, 1, 0] == 100 and list(out[0, 0, :3]) == [0, 255, 0]


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_sixteen_bit_rgb_png_is_scaled():
    # PIL cannot write 16-bit RGB, so the PNG is put together here.
    image = np.full((HEIGHT, WIDTH, 3), (32768, 65535, 0), np.uint16)
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in image)  # filter byte 0 per row
    header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 16, 2, 0, 0, 0)  # 16 bits, colour type 2 (RGB)
    data = b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(rows))
    data += png_chunk(b"IEND", b"")
    assert list(decode("png", data, 3)[:, 0, 0]) == [128, 255, 0]
    assert abs(int(decode("png", data, 1)[0, 0, 0]) - 188) <= 1  # luma of (128, 255, 0): 188.2


def test_a_format_torchvision_refuses_falls_back_to_pil():
    data = encode(solid("RGB", ORANGE), "bmp")  # named .jpg, but a BMP
    assert list(decode("jpg", data, 3)[:, 0, 0]) == list(ORANGE)
    with pytest.raises(SampleError, match="cannot decode jpg: ") as caught:
        decoder()({"jpg": b"\xff\xd8 not a jpeg", "cls": b"1"})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("field", ["png", "jpg", "ppm", "tiff", "webp"])
def test_wrong_size_is_rejected(field):
    data = encode(solid("RGB", ORANGE).resize((WIDTH, HEIGHT + 1)), field)
    with pytest.raises(SampleError, match=r"image shape \(3, 6, 6\) differs from expected \(3, 5, 6\)"):
        decoder()({field: data, "cls": b"1"})


@pytest.mark.parametrize(
    "sample, reason",
    [
        ({"png": b"not a png", "cls": b"1"}, "cannot decode png: "),
        ({"ppm": b"P6 garbage", "cls": b"1"}, "cannot decode ppm: "),
        ({"cls": b"1", "txt": b"x"}, r"no image field \(jpg; jpeg; png; .*; raw\) among fields: cls, txt"),
        ({"png": png_bytes(np.zeros((3, HEIGHT, WIDTH), np.uint8))}, "missing label"),
        ({"png": png_bytes(np.zeros((3, HEIGHT, WIDTH), np.uint8)), "cls": b"cat"}, "not an integer"),
        ({"png": png_bytes(np.zeros((3, HEIGHT, WIDTH), np.uint8)), "cls": b"10"}, r"outside 0\.\.9"),
        ({"png": png_bytes(np.zeros((3, HEIGHT, WIDTH), np.uint8)), "cls": b"-1"}, r"outside 0\.\.9"),
    ],
)
def test_bad_samples_name_the_reason_in_one_line(sample, reason):
    with pytest.raises(SampleError, match=reason) as caught:
        decoder()(sample)
    assert "\n" not in str(caught.value)


LABELED = {
    "cls": b"1",
    "cls2": b"2",
    "index": b" 3\n",
    "txt": b"4",
    "json": b'{"label": 5, "meta": {"label": 6}}',
}


@pytest.mark.parametrize(
    "label_key, label",
    [
        ("cls", 1),
        ("cls2", 2),
        ("index", 3),
        ("txt", 4),
        ("CLS", 1),
        ("json:label", 5),
        ("json:meta.label", 6),
    ],
)
def test_label_keys(label_key, label):
    assert decoder(label_key=label_key).decode_label(LABELED) == label


def test_json_label_list_index():
    assert decoder(label_key="json:labels.1").decode_label({"json": b'{"labels": [4, 7]}'}) == 7


@pytest.mark.parametrize(
    "label_key, sample, reason",
    [
        ("cls2", {"cls": b"1"}, r"missing label \(no cls2 field among: cls\)"),
        ("json:label", {"cls": b"1"}, r"missing label \(no json field"),
        ("json:meta.label", {"json": b'{"meta": {}}'}, r"missing label \(json has no meta\.label\)"),
        ("json:meta.label", {"json": b'{"meta": 3}'}, r"missing label \(json has no meta\.label\)"),
        ("json:label", {"json": b'{"label": "3"}'}, r"label \"3\" in json:label is not an integer"),
        ("json:label", {"json": b'{"label": 3.5}'}, "not an integer"),
        ("json:label", {"json": b'{"label": true}'}, "not an integer"),
        ("json:label", {"json": b'{"label": 12}'}, r"label 12 outside 0\.\.9"),
        ("json:label", {"json": b"{not json"}, "json member is not JSON: "),
        ("txt", {"txt": b"a cat"}, r"label b'a cat' in txt is not an integer"),
    ],
)
def test_bad_labels_name_the_reason(label_key, sample, reason):
    with pytest.raises(SampleError, match=reason) as caught:
        decoder(label_key=label_key).decode_label(sample)
    assert "\n" not in str(caught.value)


def test_labels_from_user_stages_are_checked_like_decoded_ones():
    # What data.stages may yield: any integer scalar, in range.
    assert [check_label(v, 10) for v in (3, np.int64(3), torch.tensor(3), np.array(3))] == [3] * 4
    for value, reason in [(42, r"label 42 outside 0\.\.9"), (-1, "outside"), (3.0, "not an integer")]:
        with pytest.raises(SampleError, match=reason):
            check_label(value, 10)
    for value in (True, "3", None, torch.tensor(3.0), np.array([3])):
        with pytest.raises(SampleError, match="not an integer"):
            check_label(value, 10)


@pytest.mark.parametrize(
    "label_key", ["json:", "json:meta.", "json:.label", "", " ", "cls;txt", "JSON:label"]
)
def test_malformed_label_keys_are_config_errors(label_key):
    with pytest.raises(ConfigError, match="label key"):
        check_label_key(label_key)
    with pytest.raises(ConfigError, match="label key"):
        decoder(label_key=label_key)


@pytest.mark.parametrize("image_key", ["", "jpg;", ";png", "jpg;;png", " "])
def test_malformed_image_keys_are_config_errors(image_key):
    with pytest.raises(ConfigError, match="image key"):
        check_image_key(image_key)
    with pytest.raises(ConfigError, match="image key"):
        decoder(image_key=image_key)


def test_good_keys_pass_the_checks():
    check_image_key(None)
    check_image_key("seg.png;jpg")
    check_label_key("json:a.b.c")
    check_label_key("cls")


def test_image_key_alternatives_and_default_order():
    png = encode(solid("RGB", (1, 1, 1)), "png")
    jpg = encode(solid("RGB", (250, 250, 250)), "jpg")
    both = {"png": png, "jpg": jpg, "seg.png": png, "cls": b"0"}
    assert decoder().image_bytes(both) == ("jpg", jpg)  # the default order: jpg before png
    assert decoder(image_key="png;jpg").image_bytes(both) == ("png", png)
    assert decoder(image_key="webp;jpg").image_bytes(both) == ("jpg", jpg)
    assert decoder(image_key="SEG.PNG").image_bytes(both) == ("seg.png", png)
    out, _ = decoder(image_key="seg.png")(both)  # the format comes from the last extension
    assert (out == 1).all()
    with pytest.raises(SampleError, match=r"no image field \(webp\) among fields: cls, jpg, png, seg\.png"):
        decoder(image_key="webp")(both)
    assert DEFAULT_IMAGE_KEYS[:3] == ("jpg", "jpeg", "png") and DEFAULT_IMAGE_KEYS[-1] == "raw"
    # Every default key is found when it is the only image.
    for key in DEFAULT_IMAGE_KEYS:
        assert decoder().image_bytes({key: b"x", "cls": b"0"}) == (key, b"x")


def test_read_image_shape():
    image = solid("RGB", ORANGE).resize((7, 3))
    for field in ("png", "jpg", "ppm", "webp", "tiff", "bmp"):
        assert read_image_shape({field: encode(image, field), "cls": b"1"}, None) == (3, 7)
    sample = {"png": encode(image, "png"), "jpg": encode(image.resize((2, 2)), "jpg")}
    assert read_image_shape(sample, "png;jpg") == (3, 7)
    assert read_image_shape(sample, None) == (2, 2)
    with pytest.raises(SampleError, match="raw pixels"):
        read_image_shape({"raw": bytes(12)}, None)
    with pytest.raises(SampleError, match="no image field"):
        read_image_shape({"cls": b"1"}, None)
    with pytest.raises(SampleError, match="cannot read png: "):
        read_image_shape({"png": b"garbage"}, None)


def test_decoder_checks_its_config_and_pickles():
    with pytest.raises(ConfigError, match="1 or 3 channels"):
        ImageDecoder(2, 4, 4, 10)
    with pytest.raises(ConfigError, match="num_classes"):
        ImageDecoder(3, 4, 4, 0)
    original = decoder(image_key="png", label_key="json:label")
    copy = pickle.loads(pickle.dumps(original))  # DataLoader workers receive it pickled
    assert copy == original and copy.shape == (3, HEIGHT, WIDTH)
    sample = {"png": encode(solid("RGB", ORANGE), "png"), "json": json.dumps({"label": 4}).encode()}
    assert copy(sample)[1] == 4


def test_an_unpickled_decoder_registers_torchvisions_ops_itself():
    """A worker forked from a fork server without our preload (one other code started first) decodes."""
    jpeg = encode(noise("RGB"), "jpg")
    payload = pickle.dumps((decoder(), {"jpg": jpeg, "cls": b"2"}))
    probe = (
        "import pickle, sys\n"
        "decoder, sample = pickle.loads(sys.stdin.buffer.read())\n"
        "image, label = decoder(sample)\n"
        "print(tuple(image.shape), label, decoder._routes['jpg'], 'torchvision' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], input=payload, capture_output=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    # Its image library only: torchvision's import (torch._dynamo, ~3 s) is not a worker's to pay.
    words = ["(3,", f"{HEIGHT},", f"{WIDTH})", "2", "torchvision", "False"]
    assert result.stdout.decode().split() == words


def test_the_read_modes_are_torchvisions():
    from torchvision.io import ImageReadMode

    from tpustream.data.format.decode import READ_GRAY, READ_RGB, READ_UNCHANGED

    modes = (ImageReadMode.UNCHANGED.value, ImageReadMode.GRAY.value, ImageReadMode.RGB.value)
    assert modes == (READ_UNCHANGED, READ_GRAY, READ_RGB)


@pytest.mark.parametrize("mode, field", [("RGB", "ppm"), ("L", "pgm")])
@pytest.mark.parametrize("channels", [1, 3])
def test_binary_pnm_is_read_directly_exactly_as_pil_converts_it(mode, field, channels):
    rng = np.random.default_rng(5)
    shape = (7, 9, 3) if mode == "RGB" else (7, 9)
    image = Image.fromarray(rng.integers(0, 256, shape).astype(np.uint8), mode)
    out = io.BytesIO()
    image.save(out, format="PPM")  # P6 for RGB, P5 for L
    expected = np.asarray(image.convert("RGB" if channels == 3 else "L"))
    expected = expected.transpose(2, 0, 1) if channels == 3 else expected[None]
    decoder = ImageDecoder(channels, 7, 9, 10)
    assert np.array_equal(decoder.decode_image(field, out.getvalue()), expected)
    with pytest.raises(SampleError, match="differs from expected"):
        ImageDecoder(channels, 9, 7, 10).decode_image(field, out.getvalue())
    with pytest.raises(SampleError, match=f"cannot decode {field}"):
        decoder.decode_image(field, out.getvalue()[:-5])  # truncated pixels: PIL's error


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("field", sorted(FORMATS))
def test_the_planning_decoder_reads_every_format_with_pil_alone(field, channels):
    """fast=False (train.py's probe of the first samples): PIL for what torchvision would read."""
    from tpustream.data.format.decode import ImageDecoder

    mode = {"pgm": "L", "pbm": "1"}.get(field, "RGB")
    data = encode(noise(mode), field)
    planning = ImageDecoder(channels, HEIGHT, WIDTH, 10, image_key=field, fast=False)
    out, label = planning({field: data, "cls": b"3"})
    assert label == 3 and out.shape == (channels, HEIGHT, WIDTH)
    assert np.array_equal(out, reference(data, channels))  # PIL's pixels exactly
    assert "torchvision" not in planning._routes.values()


def test_planning_a_run_does_not_import_torchvision(write_split):
    """train.py's process imports torchvision (and torch._dynamo with it, ~3 s) only to build one."""
    folder = write_split("train", [numbered_samples(0, 4)])
    probe = (
        "import sys, train\n"
        "from tpustream.data.resolve.split import load_split\n"
        f"load_split({folder!r}, 'train')\n"
        "print(sorted(m for m in ('torchvision', 'torch_xla') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]"]
