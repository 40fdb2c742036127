"""ImageNet crops: torchvision's distributions and geometry, DCT-domain decoding, reproducible draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import stats
from torchvision import transforms
from torchvision.transforms import v2

from tests.conftest import crop_stream, write_tar
from tests.conftest import encode_image as encode
from tpustream.data.format.decode import ImageDecoder, SampleError
from tpustream.data.read.crops import (
    CroppingDecoder,
    CropPlan,
    SampleRandom,
    center_crop_offset,
    center_plan,
    decode_crop,
    eval_resize_size,
    eval_resized_size,
    random_resized_crop,
    random_resized_plan,
)
from tpustream.data.read.loader import make_loader
from tpustream.data.resolve.split import SplitOptions, load_split


@pytest.mark.parametrize(("height", "width"), [(350, 400), (90, 1000), (1000, 60)])
def test_random_resized_crop_matches_torchvision_distribution(height, width):
    """Kolmogorov-Smirnov per parameter against RandomResizedCrop.get_params (the last two: fallbacks)."""
    draws = 3000
    ours = np.array([random_resized_crop(height, width, SampleRandom(0, 0, i)) for i in range(draws)])
    torch.manual_seed(0)
    image = torch.empty(1, height, width)
    theirs = np.array(
        [transforms.RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(draws)]
    )
    for column, name in enumerate(("top", "left", "height", "width")):
        p_value = stats.ks_2samp(ours[:, column], theirs[:, column]).pvalue
        assert p_value > 1e-3, f"{name}: KS p={p_value:.2g}"
    assert (ours[:, 2] <= height).all() and (ours[:, 3] <= width).all()
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()


def test_draws_depend_only_on_seed_epoch_and_sample():
    def crops(seed, epoch, sample):
        return [random_resized_crop(300, 400, SampleRandom(seed, epoch, sample)) for _ in range(2)]

    assert crops(1, 2, 3) == crops(1, 2, 3)
    assert len({tuple(map(tuple, crops(*key))) for key in [(1, 2, 3), (1, 3, 3), (1, 2, 4), (2, 2, 3)]}) == 4
    values = [SampleRandom(0, 0, i).random() for i in range(20000)]
    assert stats.kstest(values, "uniform").pvalue > 1e-3


def centre(size: int = 224, ratio: float = 0.875):
    return lambda height, width: center_plan(height, width, size, ratio)


def tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def test_eval_crop_geometry_is_torchvision_resize_then_center_crop():
    assert eval_resize_size(224, 0.875) == 256 and eval_resize_size(64, 0.875) == 73
    # 400x300 (WxH): Resize(256) -> 341x256 (341.33 truncated);
    # CenterCrop(224) -> top 16, left round(58.5) = 58.
    assert eval_resized_size(300, 400, 224, 0.875) == (256, 341)
    assert eval_resized_size(500, 300, 224, 0.875) == (426, 256)
    assert center_crop_offset((256, 341), 224) == (16, 58)
    assert center_plan(300, 400, 224, 0.875) == CropPlan((0, 0, 400, 300), (256, 341), (16, 58))


@pytest.mark.parametrize("size_wh", [(640, 427), (300, 500), (224, 224), (1000, 90), (257, 256)])
def test_eval_crop_equals_torchvision_pixels(photo, size_wh):
    """Bit for bit torchvision's (v2, uint8) Resize(256) + CenterCrop(224) of the decoded image tensor."""
    image = photo.resize(size_wh)
    expected = v2.Compose([v2.Resize(256), v2.CenterCrop(224)])(tensor(image))
    ours = decode_crop(encode(image, "PNG"), centre(), 224, 3, use_dct=False)
    assert ours.shape == (3, 224, 224)
    assert np.array_equal(expected.numpy(), ours)


def test_training_crop_equals_torchvision_resized_crop_and_flip(photo):
    top, left, height, width = random_resized_crop(427, 640, SampleRandom(5, 1, 9))
    plan = random_resized_plan(427, 640, 224, SampleRandom(5, 1, 9), hflip=True)
    assert plan.region == (left, top, left + width, top + height) and plan.resized == (224, 224)
    expected = v2.functional.resized_crop(tensor(photo), top, left, height, width, [224, 224])
    if plan.flip:
        expected = expected.flip(-1)
    ours = decode_crop(encode(photo, "PNG"), lambda h, w: plan, 224, 3)
    assert np.array_equal(expected.numpy(), ours)


def test_dct_downscaled_decode_is_close_to_full_decode(photo):
    """Against full decode + resize: mean absolute difference under 3 of 255 levels, PSNR over 30 dB."""
    big = encode(photo.resize((2000, 1334), Image.BICUBIC), quality=92)
    assert center_plan(1334, 2000, 224, 0.875).dct_factor() == 4
    fast = decode_crop(big, centre(), 224, 3, use_dct=True).astype(float)
    full = decode_crop(big, centre(), 224, 3, use_dct=False).astype(float)
    error = fast - full
    assert np.abs(error).mean() < 3.0
    assert 10 * math.log10(255**2 / (error**2).mean()) > 30.0
    assert CropPlan((0, 0, 447, 900), (224, 224)).dct_factor() == 1
    assert CropPlan((0, 0, 448, 900), (224, 224)).dct_factor() == 2


def test_odd_files_are_cropped_like_ordinary_ones(photo):
    """CMYK and grayscale JPEGs, a PNG under a jpg name and a 16-bit PNG: all become RGB crops."""
    crop = centre(32)
    small = photo.resize((60, 40))
    rgb = decode_crop(encode(small), crop, 32, 3)
    cmyk = decode_crop(encode(small.convert("CMYK")), crop, 32, 3)
    assert cmyk.shape == (3, 32, 32) and np.abs(cmyk.astype(int) - rgb.astype(int)).mean() < 12
    grey = decode_crop(encode(small.convert("L")), crop, 32, 3)
    assert grey.shape == (3, 32, 32) and (grey[0] == grey[1]).all()
    png_as_jpg = decode_crop(encode(small, "PNG"), crop, 32, 3)
    assert np.abs(png_as_jpg.astype(int) - rgb.astype(int)).mean() < 6
    mid_grey = Image.fromarray(np.full((40, 60), 32768, np.uint16))
    sixteen = decode_crop(encode(mid_grey, "PNG"), crop, 32, 3)
    assert sixteen.shape == (3, 32, 32) and abs(int(sixteen.mean()) - 128) <= 1
    assert decode_crop(encode(small), crop, 32, 1).shape == (1, 32, 32)
    with pytest.raises(SampleError, match="cannot decode image"):
        decode_crop(b"not an image", crop, 32, 3)


def test_a_jpeg_turbojpeg_refuses_goes_to_pil_with_the_same_crop(photo):
    """Bytes after the scan make TurboJPEG (strict) refuse; PIL decodes them, and the crop is chosen once."""
    data = encode(photo.resize((60, 40)))
    damaged = data[:-2] + b"\x00\x01\x02" + data[-2:]
    chosen = []

    def choose(height, width):
        chosen.append((height, width))
        return random_resized_plan(height, width, 32, SampleRandom(0, 0, len(chosen)), hflip=True)

    crop = decode_crop(damaged, choose, 32, 3)
    assert crop.shape == (3, 32, 32) and chosen == [(40, 60)]


def test_cropping_decoder_reads_fields_and_refuses_raw():
    decoder = ImageDecoder(3, 16, 16, 10, image_key="jpg;raw")
    epoch = CroppingDecoder(decoder, train=True, seed=0).for_epoch(3)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 50, 3), np.uint8))
    crop, label = epoch({"jpg": encode(image), "cls": b"7", "__id__": 4})
    assert crop.shape == (3, 16, 16) and label == 7
    again, _ = epoch({"jpg": encode(image), "cls": b"7", "__id__": 4})
    assert np.array_equal(crop, again)
    with pytest.raises(SampleError, match="raw pixels"):
        epoch({"raw": b"\0" * 768, "cls": b"1", "__id__": 0})


@pytest.fixture
def variable_jpeg_split(tmp_path, photo) -> str:
    """3 shards of 20 JPEGs each of another size (30..120 px a side), labels i % 10, no manifest."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "variable"
    folder.mkdir()
    for shard in range(3):
        members = []
        for i in range(shard * 20, shard * 20 + 20):
            width, height = (int(v) for v in rng.integers(30, 121, 2))
            left, top = (int(v) for v in rng.integers(0, 300, 2))
            image = photo.crop((left, top, left + 2 * width, top + 2 * height)).resize((width, height))
            members += [(f"{i:07d}.jpg", encode(image, quality=90)), (f"{i:07d}.cls", str(i % 10).encode())]
        (folder / f"train-{shard:06d}.tar").write_bytes(write_tar(members))
    return str(folder)


@pytest.mark.parametrize("workers", [0, 2])
def test_random_resized_resume_mid_epoch_is_bitwise(variable_jpeg_split, workers):
    """A pass resumed after k batches gives the uninterrupted pass's crops bit for bit; epochs differ."""
    split = load_split(
        variable_jpeg_split, "train", SplitOptions(num_classes=10, image_size=24, crop=True, progress=False)
    )

    def batches(epoch: int, skip: int = 0, train: bool = True) -> list[dict[str, torch.Tensor]]:
        stream = crop_stream(split, workers, train)
        stream.set_epoch(epoch, skip_batches=skip)
        loader = make_loader(stream, workers)
        out = list(loader)
        loader.raise_if_incomplete("train")
        loader.close()
        return out

    full = batches(2)
    assert len(full) == 8 and full[0]["image"].shape == (8, 3, 24, 24)
    rest = batches(2, skip=3)
    for a, b in zip(full[3:], rest, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert not torch.equal(batches(3)[0]["image"], full[0]["image"])
    evaluation = batches(0, train=False)
    assert torch.equal(evaluation[0]["image"], batches(5, train=False)[0]["image"])  # no randomness
