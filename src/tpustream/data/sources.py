"""Image sources for shard creation: embedded digits, CIFAR-10/100 pickles, image folders.

A source gives, per split, the class names and a sequence of samples; a
sample is (image, label) where image is a uint8 CHW array or, for image
folders, a file path decoded later in a worker process.
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

from tpustream.data.image_modes import convert_pil_image
from tpustream.errors import ConfigError, DataError

ImageRef = Union[np.ndarray, str]  # noqa: UP007 (pickled to workers; keep it obvious)


@dataclass
class SplitSource:
    """The samples of one split and its class names."""

    name: str
    classes: list[str]
    images: Sequence[ImageRef]
    labels: np.ndarray
    image_size: tuple[int, int]
    channels: int = 3

    def __len__(self) -> int:
        return len(self.labels)


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
FOLDER_SPLITS = ("train", "val", "test")


def _class_folders(root: str) -> list[str]:
    return sorted(
        d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
    )


def imagefolder_splits(path: str, image_size: int | None, default_split: str = "train") -> list[SplitSource]:
    """A folder of class folders, or of train/val/test folders that each hold class folders.

    Class names come from the train split (or the only split), sorted as
    torchvision's ImageFolder sorts them.
    """
    if not os.path.isdir(path):
        raise ConfigError(f"--source {path}: not a folder")
    if image_size is None:
        raise ConfigError("imagefolder needs --image-size: TPU graphs need one static image shape")
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
        splits.append(
            SplitSource(split, classes, files, np.asarray(labels, np.int64), (image_size, image_size))
        )
    return splits


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


def load_image_file(path: str, size: int) -> np.ndarray:
    """Decode, resize the shorter side to size and center-crop to size x size; uint8 CHW RGB.

    Raises UnreadableImageError naming the file if it cannot be read or decoded.
    """
    try:
        with Image.open(path) as opened:
            # 16-bit grey scaled to 8 bits as training decodes it (PIL's
            # convert("RGB") would clip mid grey to white), CMYK and palettes converted.
            im = Image.fromarray(convert_pil_image(opened, 3))
    # OSError: PIL.UnidentifiedImageError, truncated or vanished files;
    # SyntaxError and ValueError: malformed headers and chunks, unconvertible
    # modes; DecompressionBombError: PIL refuses images of absurd pixel counts.
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise UnreadableImageError(path, " ".join(str(exc).split()) or type(exc).__name__) from exc
    w, h = im.size
    scale = size / min(w, h)
    im = im.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BICUBIC)
    w, h = im.size
    left, top = (w - size) // 2, (h - size) // 2
    im = im.crop((left, top, left + size, top + size))
    return np.asarray(im, np.uint8).transpose(2, 0, 1).copy()
