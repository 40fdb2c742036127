"""Write one split's WebDataset tar shards and then its manifest, resumably.

The writing half of tpustream-make-shards (tpustream.data.write.command is the
command): a split is cut into shard tasks whose keys are fixed before any
image is read, so each shard is built on its own, in a worker process or not,
and its bytes do not depend on the others. Shard bytes are deterministic,
every write is atomic and identical shards already in place are skipped, and
OUTPUT/<split>/manifest.json is written last: a split is usable exactly when
its manifest exists, and a rerun after an interruption finishes the job
without rewriting what is done. Unreadable image files are left out and
counted (on_error="skip") or raise naming the file (on_error="raise").
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import signal
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from tqdm import tqdm

from tpustream import storage
from tpustream.data.format.manifest import MANIFEST_NAME, ShardInfo, ShardManifest, summarize_image_sizes
from tpustream.data.format.tar import write_tar
from tpustream.data.write.image_sources import (
    ImageRef,
    SplitSource,
    UnreadableImageError,
    load_image_file,
    original_images_format,
    read_image_file,
)
from tpustream.errors import DataError, TpustreamError

log = logging.getLogger(__name__)

# How decoded pixels can be stored (--image-format); image folders kept as
# they are say jpg or mixed in their manifest instead.
ENCODED_FORMATS = ("png", "jpg", "raw")
DEFAULT_ENCODED_FORMAT = "png"
JPEG_QUALITY = 95
# The policy words of training's data.on_error, for unreadable image files.
ON_ERROR_CHOICES = ("skip", "raise")
# Unreadable images logged per run, as training logs bad samples; the rest are only counted.
MAX_LOGGED_SKIPS = 20


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def encode_image(image: np.ndarray, image_format: str, quality: int = JPEG_QUALITY) -> bytes:
    """A uint8 CHW image as png, jpg or raw (the CHW bytes themselves)."""
    if image_format == "raw":
        return np.ascontiguousarray(image, np.uint8).tobytes()
    hwc = image.transpose(1, 2, 0)
    pil = Image.fromarray(hwc[..., 0] if hwc.shape[2] == 1 else hwc)
    out = io.BytesIO()
    if image_format == "png":
        pil.save(out, format="PNG")
    else:
        pil.save(out, format="JPEG", quality=quality)
    return out.getvalue()


@dataclass
class ShardResult:
    """What one ShardTask did."""

    url: str
    samples: int  # written into the shard: the task's keys less its skipped images
    planned: int  # the task's keys, whether written or skipped
    wrote: bool  # False when identical bytes were already in place
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) per image left out
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (height, width) per image written


@dataclass
class ShardTask:
    """One shard to build and write; pickled to a worker process."""

    url: str
    keys: list[str]
    images: list[ImageRef]
    labels: list[int]
    image_format: str  # how pixel arrays and images made image_size square are encoded
    image_size: int | None  # image files: resized and center-cropped to this square, or None: kept
    on_error: str  # "skip" or "raise", for image files that cannot be decoded
    manifest_url: str
    max_side: int | None = None  # image files kept: those with a longer side are shrunk to it
    quality: int = JPEG_QUALITY  # of every JPEG this task encodes

    def run(self) -> ShardResult:
        """Build the tar and write it unless identical bytes are already there."""
        members = []
        skipped: list[tuple[str, str]] = []
        sizes: list[tuple[int, int]] = []
        for key, image, label in zip(self.keys, self.images, self.labels, strict=True):
            try:
                name, data, size = self._stored_image(image)
            except UnreadableImageError as exc:
                if self.on_error == "raise":
                    raise
                # The other samples keep their keys (their write positions),
                # leaving a gap rather than renumbering: a shard's keys are
                # fixed before any image is read, so shards are built
                # independently and their bytes do not depend on what other
                # shards skipped.
                skipped.append((exc.path, exc.reason))
                continue
            members.append((f"{key}.{name}", data))
            members.append((f"{key}.cls", str(label).encode()))
            sizes.append(size)
        # A shard left with no samples is still written (an empty tar) and
        # listed with 0: shard names stay contiguous and the readers skip it.
        data = write_tar(members)
        samples = len(self.keys) - len(skipped)
        if storage.has_same_content(self.url, data):
            return ShardResult(self.url, samples, len(self.keys), False, skipped, sizes)
        if skipped:
            # A manifest kept from an earlier run counts this shard's images
            # as readable; it must not stay visible over fewer samples.
            storage.delete(self.manifest_url)
        storage.write_bytes(self.url, data)
        return ShardResult(self.url, samples, len(self.keys), True, skipped, sizes)

    def _stored_image(self, image: ImageRef) -> tuple[str, bytes, tuple[int, int]]:
        """(field, bytes, (height, width)) of one sample's image; UnreadableImageError for a bad file."""
        if isinstance(image, str) and self.image_size is None:
            return read_image_file(image, self.max_side, self.quality)
        if isinstance(image, str):
            image = load_image_file(image, self.image_size)
        encoded = encode_image(image, self.image_format, self.quality)
        return self.image_format, encoded, (image.shape[1], image.shape[2])


def _run_task(task: ShardTask) -> ShardResult:
    return task.run()


def _ignore_interrupts() -> None:
    """Worker initializer: Ctrl-C reaches the whole process group, but only the
    parent acts on it; a worker finishes its shard in hand (an atomic write,
    no temporary file left behind) and the parent cancels the rest."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class SkippedImages:
    """Unreadable images left out under --on-error skip: all counted, the first few logged."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}  # path -> reason, in write order

    def add(self, path: str, reason: str) -> None:
        if path in self.reasons:
            return  # an upsampled copy of an image already counted
        if len(self.reasons) < MAX_LOGGED_SKIPS:
            log.warning("skipping unreadable image %s: %s", path, reason)
        elif len(self.reasons) == MAX_LOGGED_SKIPS:
            log.warning("more unreadable images; counting them without logging")
        self.reasons[path] = reason

    def __len__(self) -> int:
        return len(self.reasons)

    def describe(self) -> str:
        """'N unreadable images skipped (first: <path>: <reason>)'."""
        path, reason = next(iter(self.reasons.items()))
        noun = "image" if len(self) == 1 else "images"
        return f"{len(self)} unreadable {noun} skipped (first: {path}: {reason})"


def sample_order(num_samples: int, upsample: int, shuffle: bool, seed: int) -> np.ndarray:
    """Source indices in write order: each sample `upsample` times, mixed when shuffling.

    Shuffling at write time matters: image folders are sorted by class, and
    shards of one class defeat any shuffle buffer of reasonable size.
    """
    order = np.tile(np.arange(num_samples), upsample)
    if shuffle:
        np.random.default_rng([seed, 0x5EED]).shuffle(order)
    return order


def write_split(
    split: SplitSource,
    output: str,
    *,
    samples_per_shard: int,
    image_format: str = DEFAULT_ENCODED_FORMAT,
    max_side: int | None = None,
    quality: int = JPEG_QUALITY,
    upsample: int = 1,
    seed: int = 0,
    workers: int = 1,
    progress: bool = True,
    on_error: str = "skip",
    skipped: SkippedImages | None = None,
) -> tuple[ShardManifest, int]:
    """Write one split's shards and then its manifest; returns (manifest, shards written).

    image_format (png, jpg or raw) encodes pixel arrays, and image files when
    the split has an image_size; without one, image files are kept as they
    are (those with a side over max_side re-encoded as JPEG) and the manifest
    says jpg or mixed. Unreadable image files are left out and added to
    skipped (on_error="skip") or raise UnreadableImageError (on_error="raise");
    the manifest counts the samples the shards really hold and, for image
    files, records their sizes.
    """
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR_CHOICES)}, got {on_error!r}")
    if image_format not in ENCODED_FORMATS:
        raise ValueError(f"image_format must be one of {', '.join(ENCODED_FORMATS)}, got {image_format!r}")
    manifest_format = image_format if split.image_size is not None else original_images_format(split.images)
    skipped = SkippedImages() if skipped is None else skipped
    folder = storage.join(output, split.name)
    manifest_url = storage.join(folder, MANIFEST_NAME)
    is_train = split.name == "train"
    order = sample_order(len(split), upsample if is_train else 1, shuffle=is_train, seed=seed)
    tasks = []
    for index, start in enumerate(range(0, len(order), samples_per_shard)):
        chunk = order[start : start + samples_per_shard]
        tasks.append(
            ShardTask(
                url=storage.join(folder, shard_name(split.name, index)),
                keys=[f"{position:08d}" for position in range(start, start + len(chunk))],
                images=[split.images[i] for i in chunk],
                labels=[int(split.labels[i]) for i in chunk],
                image_format=image_format,
                image_size=None if split.image_size is None else split.image_size[0],
                on_error=on_error,
                manifest_url=manifest_url,
                max_side=max_side,
                quality=quality,
            )
        )
    planned = _make_manifest(split, manifest_format, [ShardInfo(t.url, len(t.keys)) for t in tasks])
    # A manifest describing other shards (another seed, size or format) must
    # not stay visible while its shards are overwritten: a reader would trust
    # its counts. Without a manifest the split is plainly unusable until done.
    # The one kept is what this run writes if every image is readable (a
    # rerun of a finished run); ShardTask.run removes it if one is not.
    if not _kept_manifest_matches(manifest_url, planned, folder) and storage.delete(manifest_url):
        log.info("%s: removed the previous manifest; it describes different shards", manifest_url)
    results = _run_tasks(tasks, workers, split.name, len(order), progress)
    for result in results:
        for path, reason in result.skipped:
            skipped.add(path, reason)
    left_out = [item for result in results for item in result.skipped]
    if left_out and not any(result.samples for result in results):
        path, reason = left_out[0]
        raise DataError(
            f"every image of the {split.name} split is unreadable ({len(split)} images; "
            f"first: {path}: {reason})"
        )
    _warn_stale_shards(folder, split.name, len(tasks))
    # Written last, from the counts the shards really hold.
    manifest = _make_manifest(split, manifest_format, [ShardInfo(r.url, r.samples) for r in results])
    if split.from_files:
        manifest.size_stats = summarize_image_sizes(size for r in results for size in r.sizes)
    storage.write_bytes(manifest_url, manifest.to_json(folder).encode())
    return manifest, sum(result.wrote for result in results)


def _make_manifest(split: SplitSource, image_format: str, shards: list[ShardInfo]) -> ShardManifest:
    return ShardManifest(
        split=split.name,
        classes=split.classes,
        image_size=split.image_size,
        channels=split.channels,
        image_format=image_format,
        shards=shards,
    )


def _kept_manifest_matches(manifest_url: str, planned: ShardManifest, folder: str) -> bool:
    """Whether the manifest in place says what planned says, its image size statistics aside.

    The statistics are known only once every image has been read; what
    matters to a reader while shards are rewritten is the shards and counts.
    Equal shards, counts, size and format with other statistics (another
    --max-side) would mean other image sizes in the same number of samples:
    the statistics are briefly stale, then rewritten with the manifest.
    """
    if not storage.exists(manifest_url):
        return False
    try:
        kept = ShardManifest.from_json(storage.read_bytes(manifest_url).decode(), folder, manifest_url)
    except (TpustreamError, UnicodeDecodeError):
        return False
    return dataclasses.replace(kept, size_stats=None) == planned


def _run_tasks(
    tasks: list[ShardTask], workers: int, split: str, num_images: int, progress: bool
) -> list[ShardResult]:
    """Run the tasks (in worker processes when there are several of both); results in task order."""
    bar = tqdm(total=num_images, desc=f"{split} shards", unit="img", disable=not progress)
    pool = (
        ProcessPoolExecutor(workers, initializer=_ignore_interrupts)
        if workers > 1 and len(tasks) > 1
        else None
    )
    results = []
    try:
        outcomes: Iterable[ShardResult] = (
            pool.map(_run_task, tasks) if pool is not None else (task.run() for task in tasks)
        )
        for result in outcomes:
            results.append(result)
            bar.update(result.planned)
    finally:
        bar.close()
        if pool is not None:
            # On an error or Ctrl-C: drop the queued shards and wait for the
            # ones in hand, so no worker outlives the command.
            pool.shutdown(wait=True, cancel_futures=True)
    return results


def _warn_stale_shards(folder: str, split: str, count: int) -> None:
    """Shards of an earlier, larger run stay (we never delete user data); say so."""
    try:
        names = storage.list_names(folder)
    except TpustreamError:
        return
    pattern = re.compile(rf"{re.escape(split)}-(\d{{6}})\.tar$")
    stale = [n for n in names if (m := pattern.match(n)) and int(m.group(1)) >= count]
    if stale:
        log.warning(
            "%s: %d shard file(s) from an earlier run are not in the new manifest (first: %s); "
            "they are left in place and ignored",
            folder,
            len(stale),
            stale[0],
        )
