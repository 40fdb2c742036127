"""Sample bytes to a uint8 CHW image and an integer label, for any WebDataset sample.

PNG, JPEG and WebP go through torchvision.io (libpng/libjpeg-turbo/libwebp
directly into a tensor), which decodes a 32x32 PNG in about half the time of
PIL + convert. The other image formats go through PIL, as WebDataset's own
image handler does, with our mode conversion (PIL's convert clips 16-bit
images to white). The ``raw`` format stores planar uint8 pixels (C, H, W) and
needs no decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import operator
import os
import re
from collections.abc import Mapping

import numpy as np
import torch
from PIL import Image

from tpustream.data.format.pixels import convert_pil_image, scale_16_to_8
from tpustream.errors import ConfigError

# The fields tried, in this order, when no image key is configured.
DEFAULT_IMAGE_KEYS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "webp", "bmp", "tif", "tiff", "gif", "raw")
# Image fields (by their last extension) that torchvision decodes; the rest go to PIL.
_FAST_IMAGE_EXTENSIONS = frozenset(("png", "jpg", "jpeg", "webp"))
_RAW_EXTENSION = "raw"
_JSON_LABEL_PREFIX = "json:"
_JSON_FIELD = "json"


class SampleError(ValueError):
    """One sample cannot be used; the message says why."""


def first_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line, or its type when the message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_label(label: object, num_classes: int) -> int:
    """label as a class index; SampleError if it is not an integer or is outside 0..num_classes-1.

    For the labels decoded from shards and the ones data.stages yields alike.
    """
    try:
        # operator.index takes ints, numpy integers and integer scalar tensors,
        # not floats (int() would truncate them); bool is an int subclass, but
        # true/false is no class index.
        if isinstance(label, bool):
            raise TypeError
        index = operator.index(label)
    except TypeError:
        raise SampleError(f"label {str(label)[:20]!r} is not an integer") from None
    if not 0 <= index < num_classes:
        raise SampleError(f"label {index} outside 0..{num_classes - 1}")
    return index


def _parse_image_key(image_key: str | None) -> tuple[str, ...]:
    """The fields an image_key names, in order of preference; ConfigError if malformed."""
    if image_key is None:
        return DEFAULT_IMAGE_KEYS
    # Field names are lower-cased, as the tar reader lower-cases members' extensions.
    keys = tuple(part.strip().lower() for part in image_key.split(";"))
    if not all(keys):
        raise ConfigError(
            f"image key {image_key!r} has an empty alternative: give field names separated by ';', "
            "e.g. 'jpg;png', or leave it unset for the default order"
        )
    return keys


def _parse_label_key(label_key: str) -> tuple[str, tuple[str, ...]]:
    """(label field, path in its JSON or () for a plain integer field); ConfigError if malformed."""
    if label_key.startswith(_JSON_LABEL_PREFIX):
        path = tuple(label_key[len(_JSON_LABEL_PREFIX) :].split("."))
        if not all(path):
            raise ConfigError(
                f"label key {label_key!r} needs a JSON field after 'json:', e.g. 'json:label' or "
                "'json:meta.label' (dots separate nested fields)"
            )
        return _JSON_FIELD, path
    name = label_key.strip().lower()
    if not name or ";" in name or ":" in name:
        raise ConfigError(
            f"label key {label_key!r} is not a field name: use e.g. 'cls', 'cls2', 'index', 'txt', "
            "or 'json:<field>' for a field of the sample's json member"
        )
    return name, ()


def check_image_key(image_key: str | None) -> None:
    """Raise ConfigError if image_key is malformed (None means the default order)."""
    _parse_image_key(image_key)


def check_label_key(label_key: str) -> None:
    """Raise ConfigError if label_key is malformed."""
    _parse_label_key(label_key)


def _find_image(sample: Mapping, keys: tuple[str, ...]) -> tuple[str, bytes]:
    for key in keys:
        data = sample.get(key)
        if data is not None:
            return key, data
    fields = sorted(k for k in sample if not k.startswith("__"))
    raise SampleError(f"no image field ({'; '.join(keys)}) among fields: {', '.join(fields) or 'none'}")


def image_extension(field_name: str) -> str:
    """The format a field's name implies: its last extension (``seg.png`` -> ``png``)."""
    return field_name.rpartition(".")[2]


# How decode_image reads a field.
_FAST, _RAW, _PNM, _PIL = "torchvision", "raw", "pnm", "PIL"
_PNM_EXTENSIONS = frozenset(("ppm", "pgm"))
_PNM_HEADER = re.compile(rb"(P[56])\s+(\d+)\s+(\d+)\s+(\d+)\s")


def _read_binary_pnm(data: bytes) -> np.ndarray | None:
    """Binary 8-bit PPM (P6) / PGM (P5) pixels as (H, W, C) or (H, W) uint8, or None for other variants.

    These are a header and the pixels themselves (what webdataset's ShardWriter
    writes for "ppm", the reference CIFAR notebook's format), so a view of the
    bytes replaces a PIL decode (5.7 us against 37 us per 32x32 image here). Comments in
    the header, ASCII and bilevel variants and 16-bit maxval go to PIL.
    """
    match = _PNM_HEADER.match(data)
    if match is None or int(match.group(4)) != 255:
        return None
    width, height = int(match.group(2)), int(match.group(3))
    channels = 3 if match.group(1) == b"P6" else 1
    pixels = np.frombuffer(data, np.uint8, count=width * height * channels, offset=match.end())
    return pixels.reshape((height, width, channels) if channels == 3 else (height, width))


def _route_image(field_name: str, channels: int) -> str:
    extension = image_extension(field_name)
    if extension == _RAW_EXTENSION:
        return _RAW
    if extension in _PNM_EXTENSIONS:
        return _PNM
    # torchvision's WebP decoder ignores GRAY (returns RGB and warns): PIL makes it grey.
    if extension in _FAST_IMAGE_EXTENSIONS and not (extension == "webp" and channels == 1):
        return _FAST
    return _PIL


# torchvision.io.ImageReadMode's values, the ops' mode argument (tests/test_decode.py checks them).
READ_UNCHANGED, READ_GRAY, READ_RGB = 0, 1, 3


@functools.cache
def register_image_ops() -> None:
    """Register torch.ops.image (torchvision's image codecs) in this process, once.

    From torchvision's image library directly: `import torchvision.io` runs
    torchvision's __init__, which imports torch._dynamo, about 3 s of a fresh
    process on a 2-core VM (torchvision 0.24), paid by every loader's process
    and its workers' fork server before a first batch; the library alone
    loads in milliseconds. Loading it again (torchvision's own import, later)
    is a no-op. Where it is not where torchvision keeps it, the import does it.
    Not at module import: train.py imports this module to plan a run that may
    decode nothing.
    """
    if hasattr(torch.ops.image, "decode_image"):
        return
    spec = importlib.util.find_spec("torchvision")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        library = os.path.join(folder, "image.so")
        if os.path.exists(library):
            with contextlib.suppress(OSError):
                torch.ops.load_library(library)
                return
    import torchvision.io  # noqa: F401  (registers the ops)


def _decode_fast_unchanged(data: bytes) -> torch.Tensor:
    """(C, H, W) tensor as stored (uint8, or uint16 for 16-bit PNG); RuntimeError/ValueError if it cannot."""
    register_image_ops()
    return torch.ops.image.decode_image(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), READ_UNCHANGED, False
    )


def _pnm_to_channels(stored: np.ndarray, channels: int) -> np.ndarray:
    """(H, W, 3) or (H, W) uint8 to (channels, H, W), converting as PIL's convert("L"/"RGB") does."""
    if stored.ndim == 2:
        grey = stored[None]
        return grey if channels == 1 else np.repeat(grey, 3, axis=0)
    if channels == 3:
        return np.ascontiguousarray(stored.transpose(2, 0, 1))
    # ITU-R 601-2 luma with PIL's fixed-point rounding: L = (R*19595 + G*38470 + B*7471 + 0x8000) >> 16.
    wide = stored.astype(np.uint32)
    luma = (wide[..., 0] * 19595 + wide[..., 1] * 38470 + wide[..., 2] * 7471 + 0x8000) >> 16
    return luma.astype(np.uint8)[None]


@dataclasses.dataclass(frozen=True)
class ImageDecoder:
    """Decodes the samples of one split: image field, label field, shape and class count.

    image_key: None tries DEFAULT_IMAGE_KEYS in order; "a;b" tries a, then b.
    label_key: a field holding an integer ("cls", "cls2", "index", "txt", ...)
    or "json:<field>" / "json:<a.b>", a (nested) field of the json member.
    Field names are matched lower-cased, as the tar reader lower-cases them.
    """

    channels: int  # 1 or 3: every image becomes this many channels
    height: int
    width: int
    num_classes: int
    image_key: str | None = None
    label_key: str = "cls"
    # False: PIL reads what torchvision would (training's fallback when
    # torchvision refuses an image), and torchvision is never imported; for
    # planning's probe (data.resolve.probe), which only checks that samples
    # decode at the planned size, in the process that starts the run.
    fast: bool = True
    _image_keys: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _label_field: str = dataclasses.field(init=False, repr=False, compare=False)
    _label_path: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False)
    _read_mode: int = dataclasses.field(init=False, repr=False, compare=False)
    _shape: tuple[int, int, int] = dataclasses.field(init=False, repr=False, compare=False)
    _routes: dict[str, str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise ConfigError(f"images must have 1 or 3 channels, not {self.channels}")
        if self.height <= 0 or self.width <= 0:
            raise ConfigError(f"image size {self.height}x{self.width} must be positive")
        if self.num_classes <= 0:
            raise ConfigError(f"num_classes must be positive, not {self.num_classes}")
        label_field, label_path = _parse_label_key(self.label_key)
        # Parsed once here: the dataclass is frozen, so through object.__setattr__.
        image_keys = _parse_image_key(self.image_key)
        object.__setattr__(self, "_image_keys", image_keys)
        object.__setattr__(self, "_routes", {key: self._route(key) for key in image_keys})
        object.__setattr__(self, "_shape", (self.channels, self.height, self.width))
        object.__setattr__(self, "_label_field", label_field)
        object.__setattr__(self, "_label_path", label_path)
        if self.fast:
            register_image_ops()
            object.__setattr__(self, "_read_mode", READ_RGB if self.channels == 3 else READ_GRAY)

    def __setstate__(self, state: dict) -> None:
        # Unpickled in a DataLoader worker, __post_init__ does not run: the
        # ops are registered here, not left to the fork server's preload (a
        # server some other code started first, in the same process, has
        # none; seen in CI).
        self.__dict__.update(state)
        if self.fast:
            register_image_ops()

    def _route(self, field: str) -> str:
        route = _route_image(field, self.channels)
        return _PIL if route == _FAST and not self.fast else route

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape

    def image_bytes(self, sample: Mapping) -> tuple[str, bytes]:
        """(field, data) of the sample's image: the first of the image keys it has."""
        return _find_image(sample, self._image_keys)

    def decode_image(self, field: str, data: bytes) -> np.ndarray:
        """uint8 (C, H, W) of exactly self.shape; SampleError if it cannot be decoded or has another size.

        `field` (the member's extension, e.g. "png" or "seg.png") names the format.
        """
        route = self._routes.get(field)
        if route is None:
            route = self._route(field)
        if route == _FAST:
            try:
                # A bytearray copy (a few us) rather than frombuffer on
                # read-only bytes, which warns; catching that warning per
                # sample cost ~9 us. The registered op directly: torchvision's
                # Python wrapper adds ~3 us per call (API-usage logging,
                # argument checks) for nothing we need (torchvision is pinned
                # in pyproject.toml). EXIF orientation is not applied, as
                # neither PIL nor WebDataset's decoders apply it.
                tensor = torch.ops.image.decode_image(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8), self._read_mode, False
                )
            except (RuntimeError, ValueError) as exc:
                # Once more with PIL, which reads variants libjpeg/libpng refuse;
                # if it fails too, torchvision's reason is the one reported.
                return self._decode_with_pil(field, data, fast_error=exc)
            pixels = tensor.numpy()
            if tensor.dtype is torch.uint16:  # 16-bit PNG (torch dtypes are singletons)
                pixels = scale_16_to_8(pixels)
            if pixels.shape != self._shape:
                raise SampleError(f"image shape {pixels.shape} differs from expected {self._shape}")
            return pixels
        if route == _RAW:
            expected = self.channels * self.height * self.width
            if len(data) != expected:
                raise SampleError(f"raw image has {len(data)} bytes, shape {self._shape} needs {expected}")
            return np.frombuffer(data, np.uint8).reshape(self._shape)
        if route == _PNM:
            try:
                stored = _read_binary_pnm(data)
            except ValueError:  # fewer pixel bytes than the header promises
                stored = None
            if stored is not None:
                if stored.shape[:2] != (self.height, self.width):
                    shape = (self.channels, *stored.shape[:2])
                    raise SampleError(f"image shape {shape} differs from expected {self._shape}")
                return _pnm_to_channels(stored, self.channels)
        return self._decode_with_pil(field, data)

    def _decode_with_pil(
        self, field_name: str, data: bytes, fast_error: Exception | None = None
    ) -> np.ndarray:
        try:
            image = Image.open(io.BytesIO(data))
            # The header gives the size: a wrong-sized image is refused before
            # its pixels are decoded (and a decompression bomb never is).
            if image.size != (self.width, self.height):
                shape = (self.channels, image.size[1], image.size[0])
                raise SampleError(f"image shape {shape} differs from expected {self.shape}")
            pixels = convert_pil_image(image, self.channels)
        except SampleError:
            raise
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, EOFError, ... for bad data
            reason = first_line(fast_error if fast_error is not None else exc)
            raise SampleError(f"cannot decode {field_name}: {reason}") from None
        return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)

    def decode_label(self, sample: Mapping) -> int:
        """The sample's class from its label field; SampleError if missing, not an integer or out of range."""
        data = sample.get(self._label_field)
        if data is None:
            fields = sorted(k for k in sample if not k.startswith("__"))
            raise SampleError(
                f"missing label (no {self._label_field} field among: {', '.join(fields) or 'none'})"
            )
        if self._label_path:
            label = self._read_json_label(data)
        else:
            try:
                label = int(data)
            except ValueError:
                raise SampleError(f"label {data[:20]!r} in {self._label_field} is not an integer") from None
        return check_label(label, self.num_classes)

    def _read_json_label(self, data: bytes) -> int:
        try:
            value = json.loads(data)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise SampleError(f"json member is not JSON: {first_line(exc)}") from None
        for depth, name in enumerate(self._label_path):
            where = ".".join(self._label_path[: depth + 1])
            if isinstance(value, dict) and name in value:
                value = value[name]
            elif isinstance(value, list) and name.isdigit() and int(name) < len(value):
                value = value[int(name)]
            else:
                raise SampleError(f"missing label (json has no {where})")
        # bool is an int subclass, but true/false is no class index.
        if not isinstance(value, int) or isinstance(value, bool):
            raise SampleError(f"label {json.dumps(value)[:20]} in json:{where} is not an integer")
        return value

    def __call__(self, sample: Mapping) -> tuple[np.ndarray, int]:
        field, data = _find_image(sample, self._image_keys)
        return self.decode_image(field, data), self.decode_label(sample)


def read_image_shape(sample: Mapping, image_key: str | None) -> tuple[int, int]:
    """(height, width) of the sample's image, from its header where it has one.

    For learning a split's image size from its first sample. SampleError if
    the sample has no image field, the image cannot be read, or it is raw
    (raw pixels carry no size).
    """
    field_name, data = _find_image(sample, _parse_image_key(image_key))
    if image_extension(field_name) == _RAW_EXTENSION:
        raise SampleError(
            f"{field_name} holds raw pixels, which carry no image size: give the size explicitly"
        )
    try:
        width, height = Image.open(io.BytesIO(data)).size  # reads the header only
        return height, width
    except Exception as pil_error:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
        if image_extension(field_name) not in _FAST_IMAGE_EXTENSIONS:
            raise SampleError(f"cannot read {field_name}: {first_line(pil_error)}") from None
    try:
        tensor = _decode_fast_unchanged(data)
    except (RuntimeError, ValueError) as exc:
        raise SampleError(f"cannot read {field_name}: {first_line(exc)}") from None
    return int(tensor.shape[-2]), int(tensor.shape[-1])
