"""Crops of images of any size: the ImageNet recipe, decoding only what the crop needs.

Training takes torchvision's ``RandomResizedCrop`` (area 8-100% of the image,
aspect ratio 3/4-4/3 drawn log-uniform, 10 attempts, then a centred
fallback) plus a horizontal flip; evaluation resizes the shorter side to
``size / ratio`` (256 for 224 at 0.875) and takes the centre ``size`` square,
as torchvision's ``Resize`` + ``CenterCrop`` do.

The crop is chosen from the image's header, before its pixels are decoded:

- a JPEG is decoded by libjpeg-turbo's TurboJPEG API (simplejpeg, straight
  into a numpy array: 1.4x PIL's decoder and its copy out, in
  bench/pipeline/imagenet.py),
  at 1/2, 1/4 or 1/8 scale in the DCT domain when the crop is shrunk by at
  least that much anyway, which skips most of the work on large photos; a
  training crop's JPEG only in the crop's window (data.format.jpeg_window,
  where a C compiler built it: 8-10% more images a core, the same pixels);
- a training crop is resampled alone, in uint8, straight to the output size
  by the antialiasing bilinear filter torchvision's resize applies to
  tensors (torch's vectorised uint8 path: 3.2x PIL's resample of the same
  box in that benchmark): no full-size resized copy, no float tensor.

Every random draw comes from a counter-based generator keyed on (seed,
epoch, sample id), not from a stream, so a sample gets the same crop whichever
replica or worker reads it and however many batches a resumed run skipped.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from tpustream.data.format.decode import ImageDecoder, SampleError, first_line, image_extension
from tpustream.data.format.jpeg_window import window_decoder
from tpustream.data.format.pixels import convert_pil_image
from tpustream.errors import ConfigError

# torchvision.transforms.RandomResizedCrop's defaults.
AREA_RANGE = (0.08, 1.0)
ASPECT_RANGE = (3.0 / 4.0, 4.0 / 3.0)
ATTEMPTS = 10
# The JPEG DCT-domain scale-downs used (besides 1): libjpeg-turbo's other
# factors (M/8 between 1/2 and 1) decode slower than full size, measured.
_DCT_FACTORS = (8, 4, 2)
_MASK64 = (1 << 64) - 1


# JPEG colour spaces left to PIL, whose conversion matches the rest of the pipeline's.
PIL_COLORSPACES = ("CMYK", "YCCK")


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: a bijective, well-mixed 64-bit hash (Steele et al. 2014)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class SampleRandom:
    """Uniform draws that depend only on (seed, epoch, sample id) and the draw's position.

    Counter-based (a hash of the key and a counter), so it needs no state
    carried between samples: ~0.5 us a draw in pure Python, against ~17 us
    for seeding a numpy Generator per sample.
    """

    __slots__ = ("_key", "_counter")

    def __init__(self, seed: int, epoch: int, sample_id: int):
        self._key = _splitmix64(
            _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64)) ^ (sample_id & _MASK64)
        )
        self._counter = 0

    def random(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        self._counter += 1
        return (_splitmix64(self._key + self._counter) >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * self.random()

    def below(self, bound: int) -> int:
        """An integer in [0, bound); bias below 2^-20 for the image sizes used here."""
        return min(int(self.random() * bound), bound - 1)


def random_resized_crop(height: int, width: int, rnd: SampleRandom) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): torchvision's RandomResizedCrop.get_params, draw for draw."""
    area = height * width
    log_low, log_high = math.log(ASPECT_RANGE[0]), math.log(ASPECT_RANGE[1])
    for _ in range(ATTEMPTS):
        target_area = area * rnd.uniform(*AREA_RANGE)
        aspect = math.exp(rnd.uniform(log_low, log_high))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = rnd.below(height - crop_h + 1)
            left = rnd.below(width - crop_w + 1)
            return top, left, crop_h, crop_w
    # Fallback: the centred crop of the largest allowed aspect ratio.
    in_ratio = width / height
    if in_ratio < ASPECT_RANGE[0]:
        crop_w, crop_h = width, int(round(width / ASPECT_RANGE[0]))
    elif in_ratio > ASPECT_RANGE[1]:
        crop_h, crop_w = height, int(round(height * ASPECT_RANGE[1]))
    else:
        crop_h, crop_w = height, width
    return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w


def eval_resize_size(size: int, ratio: float) -> int:
    """The shorter side evaluation resizes to: 256 for size 224 at ratio 0.875 (as timm: floor)."""
    return int(math.floor(size / ratio))


def eval_resized_size(height: int, width: int, size: int, ratio: float) -> tuple[int, int]:
    """(height, width) after torchvision's Resize(size / ratio): shorter side exact, longer truncated."""
    short = eval_resize_size(size, ratio)
    if width <= height:
        return int(short * height / width), short
    return short, int(short * width / height)


def center_crop_offset(resized: tuple[int, int], size: int) -> tuple[int, int]:
    """(top, left) of torchvision's CenterCrop(size) in an image of size `resized`."""
    return int(round((resized[0] - size) / 2.0)), int(round((resized[1] - size) / 2.0))


@dataclass(frozen=True)
class CropPlan:
    """What to make of one image: resample `region` to `resized`, take the size x size window at `offset`.

    region: (left, top, right, bottom) in source pixels. Training: the random
    crop, resized straight to the output. Evaluation: the whole image, resized
    so its shorter side is size / ratio, and the centre window.
    """

    region: tuple[int, int, int, int]
    resized: tuple[int, int]  # (height, width)
    offset: tuple[int, int] = (0, 0)  # (top, left)
    flip: bool = False

    def dct_factor(self) -> int:
        """The largest JPEG scale-down (8, 4, 2, else 1) that leaves the region at least `resized`."""
        left, top, right, bottom = self.region
        shrink = min((right - left) / self.resized[1], (bottom - top) / self.resized[0])
        return next((factor for factor in _DCT_FACTORS if shrink >= factor), 1)


def random_resized_plan(height: int, width: int, size: int, rnd: SampleRandom, hflip: bool) -> CropPlan:
    """A training crop: RandomResizedCrop(size) then, with hflip, RandomHorizontalFlip()."""
    top, left, crop_h, crop_w = random_resized_crop(height, width, rnd)
    flip = hflip and rnd.random() < 0.5
    return CropPlan((left, top, left + crop_w, top + crop_h), (size, size), flip=flip)


def center_plan(height: int, width: int, size: int, ratio: float) -> CropPlan:
    """The evaluation crop: Resize(size / ratio) then CenterCrop(size)."""
    resized = eval_resized_size(height, width, size, ratio)
    return CropPlan((0, 0, width, height), resized, center_crop_offset(resized, size))


def _pil_pixels(image: Image.Image, channels: int) -> np.ndarray:
    """(H, W, 1 or 3) uint8 pixels of an opened image; 1 channel only when the image is grey."""
    if image.mode == "L" or (image.mode == "RGB" and channels == 3):
        pixels = np.asarray(image)  # grey stays one channel for 3 too: it is repeated after resampling
    elif image.mode == "RGB":
        pixels = np.asarray(image.convert("L"))
    else:
        # CMYK, palettes, 16-bit, alpha: converted as training converts any
        # image (rare in photo datasets, so at full size).
        pixels = convert_pil_image(image, channels)
    return pixels[..., None] if pixels.ndim == 2 else pixels


Chooser = Callable[[int, int], CropPlan]  # (height, width) -> the plan for that image


Box = tuple[int, int, int, int]  # (left, top, right, bottom) of the plan's region in decoded pixels


def _scaled_box(region: Box, factor: int, scaled_h: int, scaled_w: int) -> Box:
    """The region in an image decoded at 1/factor scale (scaled_h x scaled_w)."""
    left, top, right, bottom = region
    if factor > 1:
        # Scaled pixel j covers source pixels [j f, (j + 1) f): the region
        # scales by 1/f, rounded to whole scaled pixels.
        left, right = min(round(left / factor), scaled_w - 1), min(round(right / factor), scaled_w)
        top, bottom = min(round(top / factor), scaled_h - 1), min(round(bottom / factor), scaled_h)
    return left, top, right, bottom


def _has_end_marker(data: bytes) -> bool:
    """An EOI marker in the last KB: the window decoder never reads below its window, so a JPEG cut
    short is left to the whole-image decode, which refuses it (0xFF 0xD9 occurs nowhere
    else there: entropy-coded data stuffs every 0xFF)."""
    return data.rfind(b"\xff\xd9", max(0, len(data) - 1024)) >= 0


def _decode_jpeg(
    data: bytes, channels: int, choose: Chooser, use_dct: bool, window: bool
) -> tuple[np.ndarray, CropPlan, Box]:
    """(pixels (H, W, 1|3), plan, its region's box in them) through libjpeg-turbo; ValueError if it
    cannot (PIL then tries).

    window: only the region, through jpeg_window where it is built, else (or
    if it refuses the data) the whole image through TurboJPEG.
    """
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if colorspace in PIL_COLORSPACES:
        raise ValueError(f"{colorspace} JPEG")
    plan = choose(height, width)
    factor = plan.dct_factor() if use_dct else 1
    grey = channels == 1 or colorspace == "Gray"
    scaled_h, scaled_w = -(-height // factor), -(-width // factor)  # libjpeg's scaled size
    box = _scaled_box(plan.region, round(width / scaled_w), scaled_h, scaled_w)
    decode_window = window_decoder() if window and box != (0, 0, scaled_w, scaled_h) else None
    if decode_window is not None and _has_end_marker(data):
        try:
            pixels = decode_window(data, factor, grey, *box)
        except ValueError:  # the whole-image decode below gives its verdict
            pass
        else:
            return pixels, plan, (0, 0, box[2] - box[0], box[3] - box[1])
    # The largest scale with both sides at least these is exactly 1/factor.
    pixels = simplejpeg.decode_jpeg(
        data,
        colorspace="GRAY" if grey else "RGB",
        min_height=scaled_h,
        min_width=scaled_w,
        min_factor=factor,
    )
    scaled_h, scaled_w = pixels.shape[:2]
    return pixels, plan, _scaled_box(plan.region, round(width / scaled_w), scaled_h, scaled_w)


def _decode_pil(
    data: bytes, channels: int, choose: Chooser, use_dct: bool
) -> tuple[np.ndarray, CropPlan, Box]:
    """The same through PIL: CMYK JPEGs, PNGs named .jpg, and every other format."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    plan = choose(height, width)
    factor = 1
    if use_dct and image.format == "JPEG":
        factor = plan.dct_factor()
        if factor > 1:
            # draft picks the largest scale whose result is at least the
            # requested size: asking for width // factor gets exactly factor.
            image.draft("L" if channels == 1 else "RGB", (width // factor, height // factor))
            factor = round(width / image.size[0])  # the scale draft chose
    pixels = _pil_pixels(image, channels)
    return pixels, plan, _scaled_box(plan.region, factor, *pixels.shape[:2])


def decode_crop(
    data: bytes, choose: Chooser, size: int, channels: int, use_dct: bool = True, window: bool = True
) -> np.ndarray:
    """uint8 (channels, size, size) crop of an encoded image, planned from its header's size.

    `choose(height, width)` returns the CropPlan. A JPEG is decoded by
    libjpeg-turbo at the DCT scale the plan allows, only the region's window
    with `window` where jpeg_window is built (anything else, or a JPEG it
    refuses, by PIL); the region is resampled in uint8 by the antialiasing
    bilinear filter of torchvision's resize on tensors (torch's vectorised
    uint8 path). SampleError if neither reads the bytes. The result may be a
    strided view: the batching stage copies it into the batch, once.
    """
    plans: dict[tuple[int, int], CropPlan] = {}

    def plan_once(height: int, width: int) -> CropPlan:
        # A JPEG TurboJPEG refuses after its header goes to PIL with the same
        # plan: choosing again would draw another crop.
        if (height, width) not in plans:
            plans[height, width] = choose(height, width)
        return plans[height, width]

    try:
        pixels, plan, (left, top, right, bottom) = _decode_jpeg(data, channels, plan_once, use_dct, window)
    except ValueError:  # not a JPEG, a CMYK one, or one TurboJPEG refuses
        try:
            pixels, plan, (left, top, right, bottom) = _decode_pil(data, channels, plan_once, use_dct)
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
            raise SampleError(f"cannot decode image: {first_line(exc)}") from None
    with warnings.catch_warnings():
        # PIL's pixels are a read-only buffer, which torch warns about; they are
        # only read (a writable copy would cost ~40 us an image).
        warnings.simplefilter("ignore", UserWarning)
        region = torch.from_numpy(pixels[top:bottom, left:right]).permute(2, 0, 1)
    if tuple(region.shape[1:]) != plan.resized:
        # channels-last uint8 input takes torch's vectorised antialias path.
        region = F.interpolate(
            region[None], size=plan.resized, mode="bilinear", antialias=True, align_corners=False
        )[0]
    row, column = plan.offset
    out = region[:, row : row + size, column : column + size]
    if plan.flip:
        out = out.flip(-1)
    if out.shape[0] != channels:  # a grey image for 3 channels: one plane resampled, repeated
        out = out.expand(channels, size, size)
    return out.numpy()


def check_eval_crop_ratio(ratio: float) -> None:
    """ConfigError unless the evaluation crop ratio is in (0, 1]."""
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"data.eval_crop_ratio must be in (0, 1], got {ratio}")


@dataclass(frozen=True)
class CroppingDecoder:
    """Decodes samples of any image size to crops of decoder.shape (square).

    train: random-resized crops (and flips) drawn per (seed, epoch, sample
    id); otherwise the evaluation centre crop. Call ``for_epoch`` for the
    per-sample callable the decoding stage uses.
    """

    decoder: ImageDecoder  # finds the image and label fields; its shape is the output shape
    train: bool
    seed: int
    eval_ratio: float = 0.875
    hflip: bool = True
    use_dct: bool = True
    # (bytes, chooser, size, channels, use_dct) -> the sample's image: decode_crop's
    # pixels, or (data.decode=device) data.read.encoded.encode_crop's bytes and plan.
    crop: Callable[..., Any] = decode_crop

    def __post_init__(self) -> None:
        channels, height, width = self.decoder.shape
        if height != width:
            raise ConfigError(f"crops are square; the output size {height}x{width} is not")
        check_eval_crop_ratio(self.eval_ratio)
        # Built (once a machine) here, before the DataLoader workers start: they only load it.
        window_decoder()

    @property
    def size(self) -> int:
        return self.decoder.shape[1]

    def for_epoch(self, epoch: int) -> EpochCrops:
        return EpochCrops(self, epoch)


@dataclass(frozen=True)
class EpochCrops:
    """A CroppingDecoder fixed to one epoch: sample dict -> (uint8 CHW crop, label)."""

    owner: CroppingDecoder
    epoch: int

    def __call__(self, sample: Mapping) -> tuple[Any, int]:
        owner = self.owner
        field, data = owner.decoder.image_bytes(sample)
        if image_extension(field) == "raw":
            raise SampleError(f"{field} holds raw pixels, which carry no image size to crop from")
        label = owner.decoder.decode_label(sample)
        size = owner.size
        if owner.train:
            rnd = SampleRandom(owner.seed, self.epoch, int(sample.get("__id__", -1)))
            hflip = owner.hflip
            image = owner.crop(
                data,
                lambda h, w: random_resized_plan(h, w, size, rnd, hflip),
                size,
                owner.decoder.channels,
                owner.use_dct,
            )
        else:
            ratio = owner.eval_ratio
            image = owner.crop(
                data, lambda h, w: center_plan(h, w, size, ratio), size, owner.decoder.channels, owner.use_dct
            )
        return image, label
