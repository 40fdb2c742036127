"""Image sources for shard creation: embedded digits, CIFAR-10/100 pickles, image folders.

A source gives, per split, the class names and a sequence of samples; a
sample is (image, label) where image is a uint8 CHW array or, for image
folders, a file path read later in a worker process: its bytes kept as they
are (read_image_file) or decoded to a fixed size (load_image_file).
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
from PIL import Image

from tpustream.data.format.pixels import convert_pil_image
from tpustream.errors import ConfigError, DataError

ImageRef = Union[np.ndarray, str]  # noqa: UP007 (pickled to workers; keep it obvious)


@dataclass
class SplitSource:
    """The samples of one split and its class names."""

    name: str
    classes: list[str]
    images: Sequence[ImageRef]
    labels: np.ndarray
    image_size: tuple[int, int] | None  # (height, width); None: image files kept at their own sizes
    channels: int = 3

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def from_files(self) -> bool:
        """Whether the images are file paths (an image folder) rather than pixel arrays."""
        return len(self.images) > 0 and isinstance(self.images[0], str)


DIGITS_SIZE = 32
DIGITS_TEST_FRACTION = 0.2
CIFAR_SIZE = 32


def digits_splits(seed: int = 0) -> list[SplitSource]:
    """scikit-learn's 1,797 8x8 digits (bundled with the package), as 32x32 RGB.

    A seeded, stratified 80/20 split: 1,438 train and 359 test images.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 -> 0..255
    images = np.stack(
        [np.asarray(Image.fromarray(p).resize((DIGITS_SIZE, DIGITS_SIZE), Image.BILINEAR)) for p in pixels]
    )
    images = np.repeat(images[:, None], 3, axis=1)  # (N, 3, 32, 32)
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_mask = np.zeros(len(labels), bool)
    for cls in range(10):
        members = np.flatnonzero(labels == cls)
        test_mask[rng.choice(members, round(len(members) * DIGITS_TEST_FRACTION), replace=False)] = True
    classes = [str(c) for c in range(10)]
    size = (DIGITS_SIZE, DIGITS_SIZE)
    return [
        SplitSource("train", classes, list(images[~test_mask]), labels[~test_mask], size),
        SplitSource("test", classes, list(images[test_mask]), labels[test_mask], size),
    ]


class _CifarFiles:
    """Reads the pickles of the official "python version" from the tarball or its folder."""

    def __init__(self, path: str):
        self.path = path
        self._tar = None
        self._names: dict[str, str] = {}
        if os.path.isdir(path):
            for root, _, files in os.walk(path):
                for f in files:
                    self._names.setdefault(f, os.path.join(root, f))
        elif os.path.isfile(path) and tarfile.is_tarfile(path):
            try:
                self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 (kept open while loading parts)
                members = self._tar.getmembers()
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise ConfigError(
                    f"--source {path}: unreadable tarball ({exc}); is the download complete?"
                ) from exc
            for member in members:
                if member.isfile():
                    self._names.setdefault(os.path.basename(member.name), member.name)
        else:
            raise ConfigError(f"--source {path}: neither a CIFAR folder nor a CIFAR tarball")

    def has(self, name: str) -> bool:
        return name in self._names

    def load(self, name: str) -> dict:
        if name not in self._names:
            raise ConfigError(f"--source {self.path}: no {name!r} (is this the CIFAR python version?)")
        if self._tar is not None:
            data = self._tar.extractfile(self._names[name]).read()
        else:
            with open(self._names[name], "rb") as f:
                data = f.read()
        try:
            doc = pickle.load(io.BytesIO(data), encoding="bytes")
        except Exception as exc:  # pickle raises many types on a damaged file
            raise ConfigError(f"--source {self.path}: {name} is not a CIFAR pickle ({exc})") from exc
        return {k.decode() if isinstance(k, bytes) else k: v for k, v in doc.items()}


def _cifar_split(
    files: _CifarFiles, name: str, parts: list[str], label_key: str, classes: list[str]
) -> SplitSource:
    images, labels = [], []
    for part in parts:
        doc = files.load(part)
        images.append(np.asarray(doc["data"], np.uint8).reshape(-1, 3, CIFAR_SIZE, CIFAR_SIZE))
        labels.append(np.asarray(doc[label_key], np.int64))
    stacked = np.concatenate(images)
    return SplitSource(name, classes, list(stacked), np.concatenate(labels), (CIFAR_SIZE, CIFAR_SIZE))


def cifar_splits(path: str, variant: str) -> list[SplitSource]:
    """CIFAR-10 (data_batch_1..5, test_batch) or CIFAR-100 (train, test)."""
    files = _CifarFiles(path)
    if variant == "cifar10":
        meta = files.load("batches.meta")
        classes = [c.decode() if isinstance(c, bytes) else str(c) for c in meta["label_names"]]
        train_parts = [f"data_batch_{i}" for i in range(1, 6)]
        return [
            _cifar_split(files, "train", train_parts, "labels", classes),
            _cifar_split(files, "test", ["test_batch"], "labels", classes),
        ]
    meta = files.load("meta")
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in meta["fine_label_names"]]
    return [
        _cifar_split(files, "train", ["train"], "fine_labels", classes),
        _cifar_split(files, "test", ["test"], "fine_labels", classes),
    ]


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
JPEG_EXTENSIONS = (".jpg", ".jpeg")
FOLDER_SPLITS = ("train", "val", "test")


def _class_folders(root: str) -> list[str]:
    return sorted(
        d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
    )


def imagefolder_splits(path: str, image_size: int | None, default_split: str = "train") -> list[SplitSource]:
    """A folder of class folders, or of train/val/test folders that each hold class folders.

    Class names come from the train split (or the only split), sorted as
    torchvision's ImageFolder sorts them. image_size None keeps the files at
    their own sizes; a size makes every image size x size.
    """
    if not os.path.isdir(path):
        raise ConfigError(f"--source {path}: not a folder")
    subfolders = _class_folders(path)
    split_roots = [(s, os.path.join(path, s)) for s in FOLDER_SPLITS if s in subfolders]
    if not split_roots:
        split_roots = [(default_split, path)]
    classes = _class_folders(split_roots[0][1])
    if not classes:
        raise ConfigError(f"--source {split_roots[0][1]}: no class folders")
    index = {c: i for i, c in enumerate(classes)}
    splits = []
    for split, root in split_roots:
        files, labels = [], []
        for cls in _class_folders(root):
            if cls not in index:
                raise ConfigError(
                    f"--source {root}/{cls}: class not present in the {split_roots[0][0]} split"
                )
            class_files = [
                os.path.join(dirpath, n)
                for dirpath, _, names in sorted(os.walk(os.path.join(root, cls)))
                for n in sorted(names)
                if n.lower().endswith(IMAGE_EXTENSIONS)
            ]
            # A class the model is trained on must have training images; in
            # the other splits a class may have none (no validation images).
            if not class_files and split == split_roots[0][0]:
                raise ConfigError(
                    f"--source {os.path.join(root, cls)}: class folder has no images "
                    f"({', '.join(IMAGE_EXTENSIONS)})"
                )
            files += class_files
            labels += [index[cls]] * len(class_files)
        if not files:
            raise ConfigError(f"--source {root}: no images ({', '.join(IMAGE_EXTENSIONS)})")
        size = None if image_size is None else (image_size, image_size)
        splits.append(SplitSource(split, classes, files, np.asarray(labels, np.int64), size))
    return splits


def original_images_format(paths: Sequence[str]) -> str:
    """A manifest's image_format for image files kept as they are: jpg if all are named so, else mixed."""
    return "jpg" if all(p.lower().endswith(JPEG_EXTENSIONS) for p in paths) else "mixed"


def image_field(path: str) -> str:
    """The sample field an image file is kept under: its lower-case extension, jpeg as jpg.

    The name, not the content, decides: a PNG named .JPEG (ImageNet has one)
    stays a jpg field, and decoders tell the format from the bytes.
    """
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if extension == "jpeg" else extension


class UnreadableImageError(DataError):
    """An image file cannot be opened or decoded (make_shards skips or raises it per --on-error)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: cannot decode the image ({reason})")
        self.path = path
        self.reason = reason

    def __reduce__(self):
        # Raised in worker processes and pickled back to the parent, which
        # would otherwise call the class with the message as its only argument.
        return type(self), (self.path, self.reason)


# What PIL raises for a file it cannot read. OSError: PIL.UnidentifiedImageError,
# truncated or vanished files; SyntaxError, ValueError and EOFError: malformed
# headers and chunks, unconvertible modes; DecompressionBombError: PIL refuses
# images of absurd pixel counts.
PIL_READ_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
# Shrinking for --max-side: Lanczos, after an exact integer reduction of
# images this many times larger (PIL's reducing_gap: 3 is indistinguishable
# from plain Lanczos, and much faster on big images); JPEGs are first decoded
# at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) while still at least
# DRAFT_GAP times the target, as PIL's thumbnail() does.
REDUCING_GAP = 3.0
DRAFT_GAP = 2.0


def _unreadable(path: str, exc: BaseException) -> UnreadableImageError:
    return UnreadableImageError(path, " ".join(str(exc).split()) or type(exc).__name__)


def read_image_file(path: str, max_side: int | None, quality: int) -> tuple[str, bytes, tuple[int, int]]:
    """(field, bytes, (height, width)) of an image file stored as it is, unless too big.

    The bytes are the file's own, once PIL has checked that they decode (see
    _check_decodes). With max_side, an image whose longer side exceeds it is
    shrunk to max_side (aspect kept), converted to RGB and re-encoded as a
    JPEG at quality, under the field jpg. Raises UnreadableImageError naming
    the file if it cannot be read or decoded.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if max_side is not None and max(width, height) > max_side:
                return "jpg", *_shrink_to_jpeg(image, max_side, quality)
            _check_decodes(image)
    except PIL_READ_ERRORS as exc:
        raise _unreadable(path, exc) from exc
    return image_field(path), data, (height, width)


def _check_decodes(image: Image.Image) -> None:
    """Raise if the pixels do not decode, at a fraction of a full decode's cost.

    A JPEG is decoded at 1/8 scale: libjpeg still reads every coefficient, so a
    truncated or corrupt stream fails, but skips most of the inverse DCT. A
    PNG's chunks are checked against their CRCs (verify). Other formats, rare
    in image folders, are decoded.
    """
    if image.format in ("JPEG", "MPO"):
        image.draft(image.mode, (1, 1))
        image.load()
    elif image.format == "PNG":
        image.verify()
    else:
        image.load()


def _shrink_to_jpeg(image: Image.Image, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]]:
    """image with its longer side made max_side, as RGB JPEG bytes, and its new (height, width)."""
    width, height = image.size
    scale = max_side / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    image.draft(image.mode, (round(size[0] * DRAFT_GAP), round(size[1] * DRAFT_GAP)))
    # 16-bit grey scaled to 8 bits as training decodes it, CMYK and palettes converted.
    rgb = Image.fromarray(convert_pil_image(image, 3))
    small = rgb.resize(size, Image.LANCZOS, reducing_gap=REDUCING_GAP)
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=quality)
    return out.getvalue(), (size[1], size[0])


def load_image_file(path: str, size: int) -> np.ndarray:
    """Decode, resize the shorter side to size and center-crop to size x size; uint8 CHW RGB.

    Raises UnreadableImageError naming the file if it cannot be read or decoded.
    """
    try:
        with Image.open(path) as opened:
            # 16-bit grey scaled to 8 bits as training decodes it (PIL's
            # convert("RGB") would clip mid grey to white), CMYK and palettes converted.
            im = Image.fromarray(convert_pil_image(opened, 3))
    except PIL_READ_ERRORS as exc:
        raise _unreadable(path, exc) from exc
    w, h = im.size
    scale = size / min(w, h)
    im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    im = im.crop((left, top, left + size, top + size))
    return np.asarray(im, np.uint8).transpose(2, 0, 1).copy()
