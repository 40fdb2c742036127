"""augment.ops against torchvision's tensor kernels: every operation, per sample, within one grey level.

The reference for TrivialAugmentWide is torchvision's own application of an
(op, magnitude); for timm's RandAugment ops it is the torchvision functional
that does what timm's PIL op does (timm's SolarizeAdd, which torchvision lacks,
against timm itself).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from tpustream.augment.ops import apply_layer
from tpustream.augment.policies import (
    TRIVIAL_SPACE,
    DeviceOp,
    Op,
    RandAugment,
    TrivialAugment,
    timm_level_args,
)

FILL = [128.0, 64.0, 32.0]
HEIGHT, WIDTH = 37, 29  # odd and unequal: centres and corners are not where a square's are


def photo(batch: int, channels: int = 3) -> torch.Tensor:
    """uint8 images with smooth regions and edges, like photos (pure noise hides geometric errors)."""
    noise = torch.randint(
        0, 256, (batch, channels, HEIGHT, WIDTH), generator=torch.Generator().manual_seed(batch)
    )
    return F.avg_pool2d(noise.float(), 3, 1, 1).round().to(torch.uint8)


def apply_ops(images: torch.Tensor, ops: list[DeviceOp], bilinear: bool) -> torch.Tensor:
    """One layer over the batch, sample i taking ops[i]."""
    value = torch.tensor([op.value for op in ops], dtype=torch.float64)
    return apply_layer(
        images.float(),
        torch.tensor([int(op.code) for op in ops], dtype=torch.int32),
        torch.tensor([op.matrix for op in ops], dtype=torch.float32),
        value.float(),
        (1.0 - value).float(),
        frozenset(Op),
        bilinear,
        torch.tensor(FILL[: images.shape[1]]),
    )


def assert_within_one_grey_level(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    difference = (got - want.float()).abs()
    assert difference.max() <= 1, f"{what}: off by {difference.max():.0f} grey levels"
    # Off by one only where float rounding differs (torchvision's CPU kernels fuse multiply-adds),
    # not systematically (a floor for a round would move about half the pixels).
    assert (difference > 0).float().mean() < 0.1, (
        f"{what}: {(difference > 0).float().mean():.1%} pixels differ"
    )


@pytest.mark.parametrize("interpolation", [InterpolationMode.NEAREST, InterpolationMode.BILINEAR])
def test_trivialaugment_ops_equal_torchvisions_at_every_kind_of_magnitude(interpolation):
    reference = v2.TrivialAugmentWide(interpolation=interpolation, fill=FILL)
    cases = []
    for name, (magnitudes, signed) in TRIVIAL_SPACE.items():
        if magnitudes is None:
            cases.append((name, 0.0))
            continue
        for index in (0, 7, 15, 20, 30):  # 20: Rotate's 90 degrees, torchvision's rot90 path
            cases.append((name, float(magnitudes[index])))
        if signed:
            cases.append((name, -float(magnitudes[23])))
    images = photo(len(cases))
    got = apply_ops(
        images,
        [TrivialAugment.to_device(case, HEIGHT, WIDTH) for case in cases],
        bilinear=interpolation == InterpolationMode.BILINEAR,
    )
    for index, (name, magnitude) in enumerate(cases):
        want = reference._apply_image_or_video_transform(
            images[index], name, magnitude, interpolation=interpolation, fill=reference._fill
        )
        assert_within_one_grey_level(got[index], want, f"{name} {magnitude:+.3f} ({interpolation.value})")


def torchvision_equivalent(name: str, args: tuple, image: torch.Tensor, interpolation) -> torch.Tensor:
    """What timm's PIL op does, by torchvision's tensor functional."""
    base = name.removesuffix("Increasing")
    geometry = {"interpolation": interpolation, "fill": FILL}
    if base == "Rotate":
        return TF.rotate(image, args[0], **geometry)
    if base in ("ShearX", "ShearY"):
        degrees = math.degrees(math.atan(args[0]))
        shear = [degrees, 0.0] if base == "ShearX" else [0.0, degrees]
        return TF.affine(image, 0.0, [0, 0], 1.0, shear, center=[0, 0], **geometry)
    if base in ("TranslateXRel", "TranslateYRel"):
        pixels = args[0] * (WIDTH if base == "TranslateXRel" else HEIGHT)
        translate = [-pixels, 0.0] if base == "TranslateXRel" else [0.0, -pixels]
        return TF.affine(image, 0.0, translate, 1.0, [0.0, 0.0], **geometry)
    if base == "SolarizeAdd":  # timm's own (PIL lookup table): torchvision has none
        from timm.data.auto_augment import solarize_add

        pil = Image.fromarray(image.permute(1, 2, 0).numpy())
        return torch.from_numpy(np.array(solarize_add(pil, *args))).permute(2, 0, 1)
    if base == "Solarize" and args[0] > 255:
        return image  # nothing reaches 256
    functional = {
        "Color": TF.adjust_saturation,
        "Contrast": TF.adjust_contrast,
        "Brightness": TF.adjust_brightness,
        "Sharpness": TF.adjust_sharpness,
        "Posterize": TF.posterize,
        "Solarize": TF.solarize,
        "AutoContrast": TF.autocontrast,
        "Equalize": TF.equalize,
        "Invert": TF.invert,
    }[base]
    return functional(image, *args)


@pytest.mark.parametrize("interpolation", [InterpolationMode.NEAREST, InterpolationMode.BILINEAR])
def test_randaugment_ops_equal_torchvisions_at_timms_levels(monkeypatch, interpolation):
    import timm.data.auto_augment as timm_aa

    rng = np.random.default_rng(0)
    cases = []
    for name in dict.fromkeys(timm_aa._RAND_TRANSFORMS + timm_aa._RAND_INCREASING_TRANSFORMS):
        for level in (0.0, 4.3, 9.0, 10.0):
            ours = timm_level_args(name, level, rng)
            # timm's level args with either sign its _randomly_negate can draw: ours is one of them.
            level_fn = timm_aa.LEVEL_TO_ARG[name]
            if level_fn is not None:
                signs = []
                for draw in (0.0, 1.0):
                    monkeypatch.setattr(timm_aa.random, "random", lambda draw=draw: draw)
                    signs.append(pytest.approx(level_fn(level, {})))
                monkeypatch.undo()
                assert ours in signs, f"{name} at {level}: {ours} not in {signs}"
            cases.append((name, ours))
    images = photo(len(cases))
    got = apply_ops(
        images,
        [RandAugment.to_device(case, HEIGHT, WIDTH) for case in cases],
        interpolation.value == "bilinear",
    )
    for index, (name, args) in enumerate(cases):
        want = torchvision_equivalent(name, args, images[index], interpolation)
        assert_within_one_grey_level(got[index], want, f"{name}{args}")


def test_single_channel_images_follow_torchvision():
    """Saturation leaves grey images alone; contrast blends towards their own mean."""
    images = photo(3, channels=1)
    ops = [DeviceOp(Op.color, value=0.3), DeviceOp(Op.contrast, value=1.6), DeviceOp(Op.equalize)]
    got = apply_ops(images, ops, bilinear=False)
    want = [TF.adjust_saturation(images[0], 0.3), TF.adjust_contrast(images[1], 1.6), TF.equalize(images[2])]
    for index, reference in enumerate(want):
        assert_within_one_grey_level(got[index], reference, str(ops[index].code))


def test_equalize_and_autocontrast_leave_flat_channels_as_torchvision_does():
    flat = torch.full((2, 3, 8, 8), 77, dtype=torch.uint8)
    flat[1, 0, :4] = 200  # one channel with two levels, the others flat
    got = apply_ops(flat, [DeviceOp(Op.equalize), DeviceOp(Op.autocontrast)], bilinear=False)
    assert torch.equal(got[0], TF.equalize(flat[0]).float())
    assert torch.equal(got[1], TF.autocontrast(flat[1]).float())
