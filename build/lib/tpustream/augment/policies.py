"""RandAugment (timm's config string) and TrivialAugmentWide (torchvision): the host's per-sample draws.

A policy draws each sample's operations in its library's own terms (timm's op
names and level arguments, torchvision's op names and signed magnitudes), with
the library's distributions, from the sample's generator; ``to_device`` turns
one into what the device applies (``ops``): an operation code, an inverse
affine matrix for the geometric ones and a value (factor, bits, threshold).

Every sample has the policy's number of layers; a layer that does nothing
(timm's per-op probability, torchvision's Identity) is the identity code, so
the device's graph never depends on what was drawn.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from tpustream.config import AugmentConfig
from tpustream.errors import ConfigError

# timm/data/auto_augment.py: magnitudes are on a 0..10 scale.
LEVEL_DENOM = 10.0
TRANSLATE_PCT = 0.45

RAND_TRANSFORMS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip
RAND_INCREASING_TRANSFORMS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
    "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)  # fmt: skip
# timm's _RAND_WEIGHTED_0 ("t" section "weights"): chosen without replacement.
RAND_WEIGHTED = {
    "Rotate": 3, "ShearX": 2, "ShearY": 2, "TranslateXRel": 1, "TranslateYRel": 1,
    "ColorIncreasing": 0.25, "SharpnessIncreasing": 0.25, "AutoContrast": 0.25,
    "SolarizeIncreasing": 0.05, "SolarizeAdd": 0.05, "ContrastIncreasing": 0.05,
    "BrightnessIncreasing": 0.05, "Equalize": 0.05, "PosterizeIncreasing": 0.05, "Invert": 0.05,
}  # fmt: skip

# torchvision.transforms.v2.TrivialAugmentWide's space: op -> (magnitudes of 31 bins, signed),
# made with torch as torchvision makes them (np.linspace can differ by an ulp, and
# TranslateX's int() of 15.999999 is not 16's).
TRIVIAL_BINS = 31


def _bins(low: float, high: float) -> np.ndarray:
    return torch.linspace(low, high, TRIVIAL_BINS).numpy()


TRIVIAL_SPACE: dict[str, tuple[np.ndarray | None, bool]] = {
    "Identity": (None, False),
    "ShearX": (_bins(0.0, 0.99), True),
    "ShearY": (_bins(0.0, 0.99), True),
    "TranslateX": (_bins(0.0, 32.0), True),
    "TranslateY": (_bins(0.0, 32.0), True),
    "Rotate": (_bins(0.0, 135.0), True),
    "Brightness": (_bins(0.0, 0.99), True),
    "Color": (_bins(0.0, 0.99), True),
    "Contrast": (_bins(0.0, 0.99), True),
    "Sharpness": (_bins(0.0, 0.99), True),
    "Posterize": ((8 - (torch.arange(TRIVIAL_BINS) / ((TRIVIAL_BINS - 1) / 6))).round().int().numpy(), False),
    "Solarize": (_bins(1.0, 0.0), False),
    "AutoContrast": (None, False),
    "Equalize": (None, False),
}


class Op(IntEnum):
    """What the device applies to a sample in one layer (augment.ops)."""

    identity = 0
    affine = 1  # matrix: torchvision's inverse affine matrix, centred coordinates
    brightness = 2  # value: factor
    color = 3
    contrast = 4
    sharpness = 5
    posterize = 6  # value: the quantisation step, 2 ** (8 - bits kept)
    solarize = 7  # value: threshold (>= it inverts)
    solarize_add = 8  # value: added below 128 (timm's SolarizeAdd)
    autocontrast = 9
    equalize = 10
    invert = 11


@dataclass(frozen=True)
class DeviceOp:
    code: Op
    matrix: tuple[float, ...] = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
    value: float = 0.0


def inverse_affine_matrix(
    center: tuple[float, float], angle: float, translate: tuple[float, float], shear: tuple[float, float]
) -> tuple[float, ...]:
    """torchvision's _get_inverse_affine_matrix (scale 1): output to input pixel, centred coordinates."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cx, cy = center
    tx, ty = translate
    cos_sy, tan_sx = math.cos(sy), math.tan(sx)
    a = math.cos(rot - sy) / cos_sy
    b = -(a * tan_sx + math.sin(rot))
    c = math.sin(rot - sy) / cos_sy
    d = math.cos(rot) - c * tan_sx
    m = [d, -b, 0.0, -c, a, 0.0]
    m[2] += cx - m[0] * (cx + tx) - m[1] * (cy + ty)
    m[5] += cy - m[3] * (cx + tx) - m[4] * (cy + ty)
    return tuple(m)


def affine(
    height: int, width: int, *, angle=0.0, translate=(0.0, 0.0), shear=(0.0, 0.0), corner=False
) -> DeviceOp:
    """torchvision's F.affine (corner: center=[0, 0], PIL's origin for shears); F.rotate is angle=-degrees."""
    center = (-width * 0.5, -height * 0.5) if corner else (0.0, 0.0)
    return DeviceOp(Op.affine, inverse_affine_matrix(center, angle, translate, shear))


def shear(height: int, width: int, factor: float, vertical: bool = False) -> DeviceOp:
    """PIL's shear (1, f, 0, 0, 1, 0) about the corner, as torchvision's: an affine shear of atan(f)."""
    degrees = math.degrees(math.atan(factor))
    return affine(height, width, shear=(0.0, degrees) if vertical else (degrees, 0.0), corner=True)


def posterize(bits: int) -> DeviceOp:
    """Keep `bits` high bits: quantise to steps of 2 ** (8 - bits), the power taken here, on the host
    (torch.exp2 has no XLA lowering: on the device it fell back to the CPU and cut the step's graph)."""
    return DeviceOp(Op.posterize, value=float(2 ** (8 - min(max(int(bits), 0), 8))))


# -- timm's RandAugment --------------------------------------------------------
@dataclass(frozen=True)
class RandAugment:
    """timm's rand_augment_transform(config_str): 'rand-m9-n2-mstd0.5-inc1-mmax10-p0.5-tweights'."""

    magnitude: float = 10.0
    layers: int = 2
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float | None = None
    transforms: tuple[str, ...] = RAND_TRANSFORMS
    weights: tuple[float, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> RandAugment:
        """The config string, as timm reads it; a one-line error naming what is wrong."""
        name = f"augment.randaugment={text!r}"
        sections = text.split("-")
        if sections[0] != "rand":
            raise ConfigError(
                f"{name}: timm's RandAugment strings start with 'rand-' (e.g. rand-m9-mstd0.5-inc1)"
            )
        values: dict = {}
        increasing, transform_set = False, None
        for section in sections[1:]:
            if section.startswith("t"):
                transform_set = section[1:]
                continue
            match = re.fullmatch(r"([a-z]*)(\d.*)", section)
            if match is None:
                raise ConfigError(
                    f"{name}: section {section!r} has no number (m9, n2, mstd0.5, mmax10, inc1, p0.5)"
                )
            key, value = match.groups()
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"{name}: section {section!r}: {value!r} is not a number") from None
            if key == "m":
                values["magnitude"] = float(int(number))
            elif key == "n":
                values["layers"] = int(number)
            elif key == "p":
                values["prob"] = number
            elif key == "mstd":
                values["magnitude_std"] = math.inf if number > 100 else number
            elif key == "mmax":
                values["magnitude_max"] = float(int(number))
            elif key == "inc":
                increasing = bool(int(number))
            else:
                raise ConfigError(
                    f"{name}: unknown section {section!r} (timm's are m, n, p, mstd, mmax, inc, t)"
                )
        if transform_set is None:
            values["transforms"] = RAND_INCREASING_TRANSFORMS if increasing else RAND_TRANSFORMS
        elif transform_set == "weights":
            total = sum(RAND_WEIGHTED.values())
            values["transforms"] = tuple(RAND_WEIGHTED)
            values["weights"] = tuple(w / total for w in RAND_WEIGHTED.values())
        else:
            raise ConfigError(
                f"{name}: transform set {transform_set!r} is not built on the device (only the default "
                "sets, chosen by inc0/inc1, and tweights)"
            )
        spec = cls(**values)
        if spec.layers < 1 or not 0 <= spec.prob <= 1 or spec.magnitude_std < 0:
            raise ConfigError(f"{name}: needs n >= 1, 0 <= p <= 1 and mstd >= 0")
        if spec.weights is not None and spec.layers > len(spec.transforms):
            raise ConfigError(f"{name}: weighted choice is without replacement: n <= {len(spec.transforms)}")
        return spec

    def draw(self, rng: np.random.Generator) -> list[tuple[str, tuple] | None]:
        """One sample's layers as timm's (op name, level args), None where the op's probability skips it."""
        if self.weights is None:
            chosen = rng.integers(0, len(self.transforms), size=self.layers)
        else:
            chosen = rng.choice(len(self.transforms), self.layers, replace=False, p=self.weights)
        layers: list[tuple[str, tuple] | None] = []
        for index in chosen:
            name = self.transforms[int(index)]
            # AugmentOp.__call__: skipped when random() > prob.
            if self.prob < 1.0 and rng.random() > self.prob:
                layers.append(None)
                continue
            magnitude = self.magnitude
            if self.magnitude_std == math.inf:
                magnitude = rng.uniform(0, magnitude)
            elif self.magnitude_std > 0:
                magnitude = rng.normal(magnitude, self.magnitude_std)
            magnitude = max(0.0, min(magnitude, self.magnitude_max or LEVEL_DENOM))
            layers.append((name, timm_level_args(name, magnitude, rng)))
        return layers

    @staticmethod
    def to_device(layer: tuple[str, tuple] | None, height: int, width: int) -> DeviceOp:
        """timm's op (PIL semantics) as torchvision's tensor op on the device."""
        if layer is None:
            return DeviceOp(Op.identity)
        name, args = layer
        base = re.sub("Increasing$", "", name)
        if base in ("Color", "Contrast", "Brightness", "Sharpness"):
            return DeviceOp(Op[base.lower()], value=args[0])
        if base == "Rotate":  # PIL rotates counter-clockwise, as F.rotate
            return affine(height, width, angle=-args[0])
        if base in ("ShearX", "ShearY"):
            return shear(height, width, args[0], vertical=base == "ShearY")
        if base == "TranslateXRel":  # PIL samples input(x + pixels): the content moves by -pixels
            return affine(height, width, translate=(-args[0] * width, 0.0))
        if base == "TranslateYRel":
            return affine(height, width, translate=(0.0, -args[0] * height))
        if base == "Posterize":
            return posterize(args[0])
        if base == "Solarize":
            return DeviceOp(Op.solarize, value=float(args[0]))
        if base == "SolarizeAdd":
            return DeviceOp(Op.solarize_add, value=float(args[0]))
        return DeviceOp(CODES[base])  # AutoContrast, Equalize, Invert: no argument


def _negate(value: float, rng: np.random.Generator) -> float:
    """timm's _randomly_negate: -v when random() > 0.5."""
    return -value if rng.random() > 0.5 else value


def timm_level_args(name: str, level: float, rng: np.random.Generator) -> tuple:
    """timm's LEVEL_TO_ARG for the ops built here (the signed ones draw their sign from rng)."""
    fraction = level / LEVEL_DENOM
    if name == "Rotate":
        return (_negate(fraction * 30.0, rng),)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return (fraction * 1.8 + 0.1,)
    if name.endswith("Increasing") and not name.startswith(("Posterize", "Solarize")):
        return (max(0.1, 1.0 + _negate(fraction * 0.9, rng)),)
    if name in ("ShearX", "ShearY"):
        return (_negate(fraction * 0.3, rng),)
    if name in ("TranslateXRel", "TranslateYRel"):
        return (_negate(fraction * TRANSLATE_PCT, rng),)
    if name == "Posterize":
        return (int(fraction * 4),)
    if name == "PosterizeIncreasing":
        return (4 - int(fraction * 4),)
    if name == "Solarize":
        return (min(256, int(fraction * 256)),)
    if name == "SolarizeIncreasing":
        return (256 - min(256, int(fraction * 256)),)
    if name == "SolarizeAdd":
        return (min(128, int(fraction * 110)),)
    return ()  # AutoContrast, Equalize, Invert


# -- torchvision's TrivialAugmentWide -----------------------------------------
@dataclass(frozen=True)
class TrivialAugment:
    """torchvision.transforms.v2.TrivialAugmentWide: one op of 14, one of 31 magnitudes, a random sign."""

    layers: int = 1

    def draw(self, rng: np.random.Generator) -> list[tuple[str, float]]:
        name = list(TRIVIAL_SPACE)[int(rng.integers(0, len(TRIVIAL_SPACE)))]
        magnitudes, signed = TRIVIAL_SPACE[name]
        magnitude = 0.0
        if magnitudes is not None:
            magnitude = float(magnitudes[int(rng.integers(0, TRIVIAL_BINS))])
            if signed and rng.random() <= 0.5:
                magnitude = -magnitude
        return [(name, magnitude)]

    @staticmethod
    def to_device(layer: tuple[str, float], height: int, width: int) -> DeviceOp:
        """torchvision's _AutoAugmentBase._apply_image_or_video_transform for this op and magnitude."""
        name, magnitude = layer
        if name in ("ShearX", "ShearY"):
            return shear(height, width, magnitude, vertical=name == "ShearY")
        if name == "TranslateX":
            return affine(height, width, translate=(float(int(magnitude)), 0.0))
        if name == "TranslateY":
            return affine(height, width, translate=(0.0, float(int(magnitude))))
        if name == "Rotate":
            return affine(height, width, angle=-magnitude)
        if name in ("Brightness", "Color", "Contrast", "Sharpness"):
            return DeviceOp(Op[name.lower()], value=1.0 + magnitude)
        if name == "Posterize":
            return posterize(int(magnitude))
        if name == "Solarize":
            return DeviceOp(Op.solarize, value=255.0 * magnitude)
        return DeviceOp(CODES[name])  # Identity, AutoContrast, Equalize: no argument


# Library op names -> the device's codes (the geometric ones all warp).
CODES = {
    "Identity": Op.identity, "AutoContrast": Op.autocontrast, "Equalize": Op.equalize, "Invert": Op.invert,
    "Posterize": Op.posterize, "Solarize": Op.solarize, "SolarizeAdd": Op.solarize_add,
    "Color": Op.color, "Contrast": Op.contrast, "Brightness": Op.brightness, "Sharpness": Op.sharpness,
    **dict.fromkeys(("Rotate", "ShearX", "ShearY"), Op.affine),
    **dict.fromkeys(("TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel"), Op.affine),
}  # fmt: skip


def policy_ops(policy: RandAugment | TrivialAugment) -> frozenset[Op]:
    """The codes a policy can produce: the device builds only those."""
    names = TRIVIAL_SPACE if isinstance(policy, TrivialAugment) else policy.transforms
    return frozenset({Op.identity} | {CODES[re.sub("Increasing$", "", name)] for name in names})


def build_policy(cfg: AugmentConfig) -> RandAugment | TrivialAugment | None:
    """The per-sample operation policy augment.* names, or None; ConfigError for a RandAugment
    string timm would not read (launch.checks builds it once before spawning to say so)."""
    if cfg.randaugment:
        return RandAugment.parse(cfg.randaugment)
    return TrivialAugment() if cfg.trivialaugment else None
