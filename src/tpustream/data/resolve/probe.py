"""What a split holds beyond counts: classes, image shape and format, and a check of its first samples.

From the config, our manifest, or the first sample that decodes. For
training, the first samples are also read with the configured image and
label keys, so a wrong key fails before spawning rather than after an epoch
of bad samples.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from tpustream import storage
from tpustream.data.format.decode import (
    DEFAULT_IMAGE_KEYS,
    ImageDecoder,
    SampleError,
    image_extension,
    read_image_shape,
)
from tpustream.data.format.manifest import ShardInfo, ShardManifest
from tpustream.data.format.tar import ShardFormatError, iter_shard_samples, open_tar_stream
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.shard_spec import describe_spec
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)


def describe_images(
    spec: str | Sequence[str],
    split: str,
    shards: list[ShardInfo],
    manifests: list[ShardManifest],
    options: SplitOptions,
) -> ShardManifest:
    """Classes, image shape and channels: from the config, our manifest, or the first sample."""
    name = describe_spec(spec)
    first = manifests[0] if manifests else None
    for other in manifests[1:]:
        if (other.classes, other.image_size, other.channels) != (
            first.classes,
            first.image_size,
            first.channels,
        ):
            raise ConfigError(f"{name}: the manifests of these shards disagree on classes or image shape")
    if first is not None:
        classes = first.classes
        if options.num_classes is not None and options.num_classes != len(classes):
            raise ConfigError(
                f"data.num_classes={options.num_classes}, but the manifest of {name} lists "
                f"{len(classes)} classes"
            )
    elif options.num_classes is not None:
        if options.num_classes < 1:
            raise ConfigError(f"data.num_classes must be at least 1, got {options.num_classes}")
        classes = [str(c) for c in range(options.num_classes)]
    else:
        raise ConfigError(
            f"{name}: the shards have no tpustream manifest naming their classes; set data.num_classes"
        )
    channels = options.channels or (first.channels if first else 3)
    stored = first.image_size if first is not None else None
    if options.crop:
        # The stored sizes do not matter: every image is cropped to image_size.
        if options.image_size is not None:
            image_size = (options.image_size, options.image_size)
        elif stored is not None and stored[0] == stored[1]:
            image_size = stored
        else:
            raise ConfigError(f"{name}: set data.image_size, the side of the square crops")
        image_format = first.image_format if first else (options.image_key or "")
    elif first is not None and stored is None:
        # Images of many sizes, not cropped: fine for tools; training refuses
        # it (launch.checks.check_data) since one graph needs one shape.
        image_size, image_format = None, first.image_format
    elif options.image_size is not None:
        image_size = (options.image_size, options.image_size)
        if first is not None and stored != image_size:
            raise ConfigError(
                f"data.image_size={options.image_size}, but the manifest of {name} says its images are "
                f"{stored[0]}x{stored[1]}"
            )
        image_format = first.image_format if first else (options.image_key or "")
    elif first is not None:
        image_size, image_format = stored, first.image_format
    else:
        image_size, image_format = _first_image_shape(shards, options.image_key, name)
        log.info("%s: images are %dx%d (%s), from the first sample", name, *image_size, image_format)
    size_stats = first.size_stats if first else None
    largest = tuple(size_stats["max"]) if size_stats else stored
    return ShardManifest(
        split or (first.split if first else ""),
        classes,
        image_size,
        channels,
        image_format,
        shards,
        size_stats=size_stats,
        stored_size=largest if options.crop else None,
    )


# Samples read, at most, to find one that training can use. Bad samples are
# counted and skipped in training (data.max_bad_fraction), so a few at the
# start must not stop a run; a key is blamed only when no sample of this many
# has its field. 64 is far past any plausible run of bad data at a split's
# start, and costs milliseconds: the samples are read only until one works.
PROBED_SAMPLES = 64


def _first_image_shape(
    shards: list[ShardInfo], image_key: str | None, name: str
) -> tuple[tuple[int, int], str]:
    """(height, width) and image field of the first sample that decodes, from the first non-empty shards.

    At most PROBED_SAMPLES samples, and three shards: a shard that cannot be
    read is not a reason to read the whole split.
    """
    reasons = []
    for shard in [s for s in shards if s.samples > 0][:3]:
        try:
            with storage.open_read(shard.url) as raw, open_tar_stream(raw, shard.url) as stream:
                left = PROBED_SAMPLES - len(reasons)
                for sample in iter_shard_samples(stream, shard.url, 0, min(left, shard.samples)):
                    try:
                        shape = read_image_shape(sample, image_key)
                    except SampleError as exc:
                        reasons.append(f"{shard.url} sample {sample['__key__']}: {exc}")
                        continue
                    keys = image_key.split(";") if image_key else DEFAULT_IMAGE_KEYS
                    return shape, next((k for k in keys if k in sample), "")
        except (StorageError, ShardFormatError) as exc:
            reasons.append(str(exc))
        if len(reasons) >= PROBED_SAMPLES:
            break
    # A field that is there but does not decode is bad data, and says more than a missing one.
    found = [r for r in reasons if "no image field" not in r]
    first_reason = (found or reasons or ["no samples"])[0]
    raise ConfigError(
        f"{name}: cannot learn the image size from the first samples ({first_reason}){_advice(first_reason)}"
    )


def _advice(reason: str) -> str:
    """What to set, for why the first samples gave no image size: only the setting that can help."""
    if "no image field" in reason:
        # A field named otherwise (a dotted name such as "x.png") or not an image
        # at all (npy arrays): data.image_size cannot help.
        return (
            "; set data.image_key to the field that holds the encoded image (e.g. data.image_key=x.png "
            "for a field x.png); arrays such as npy are not images tpustream decodes"
        )
    if "raw pixels" in reason:
        return "; raw pixels carry no size: set data.image_size (and data.channels)"
    return "; check data.image_key, or set data.image_size"


class SampleProblem(NamedTuple):
    """Why training could not use a sample; missing_field: the configured key found no field in it."""

    reason: str
    missing_field: bool


def check_first_samples(manifest: ShardManifest, options: SplitOptions, name: str) -> None:
    """ConfigError unless one of the first samples gives an image and a label as training reads them.

    Samples are read, from the first non-empty shards on, until one works (at
    most PROBED_SAMPLES). Those before it are bad data, which training skips
    and counts. If none works, the error blames a key only when no sample read
    had its field; otherwise it names the first sample's problem as bad data.
    """
    # Varying sizes without cropping never train (launch.checks.check_data
    # says so); the stand-in size only lets the label be read here.
    height, width = manifest.image_size or (1, 1)
    decoder = ImageDecoder(
        manifest.channels,
        height,
        width,
        manifest.num_classes,
        options.image_key,
        options.label_key,
        fast=False,
    )
    problems: list[SampleProblem] = []
    for shard in [s for s in manifest.shards if s.samples > 0]:
        try:
            with storage.open_read(shard.url) as raw, open_tar_stream(raw, shard.url) as stream:
                left = PROBED_SAMPLES - len(problems)
                for sample in iter_shard_samples(stream, shard.url, 0, min(left, shard.samples)):
                    where = f"sample {sample['__key__']} of {shard.url}"
                    problem = _sample_problem(sample, where, decoder, manifest, options)
                    if problem is None:
                        return
                    problems.append(problem)
        except (StorageError, ShardFormatError) as exc:
            # Training reads the shard again and handles this under data.on_error.
            log.warning("%s: cannot read a first sample to check the image and label keys (%s)", name, exc)
            return
        if len(problems) >= PROBED_SAMPLES:
            break
    if not problems:
        return
    bad_data = [p for p in problems if not p.missing_field]
    if not bad_data:
        raise ConfigError(f"{name}: {problems[0].reason}")
    raise ConfigError(
        f"{name}: none of the first {len(problems)} samples gives an image and a label as training reads "
        f"them; the first: {bad_data[0].reason}"
    )


def _sample_problem(
    sample: Mapping, where: str, decoder: ImageDecoder, manifest: ShardManifest, options: SplitOptions
) -> SampleProblem | None:
    """Why training could not use this sample, naming the setting at fault; None if it could.

    A missing field's reason (SampleError's) lists the fields the sample has.
    """
    label_key = f"data.label_key={options.label_key}"
    try:
        decoder.decode_label(sample)
    except SampleError as exc:
        if str(exc).startswith("label ") and " outside 0.." in str(exc):
            # The key works; the class count is what does not fit.
            return SampleProblem(
                f"{where} has {exc} (the split's {decoder.num_classes} classes): set data.num_classes, "
                f"or check {label_key}",
                False,
            )
        json_fields = _json_fields(sample, options.label_key)
        # No label field, or no such field in the sample's json: the key found nothing.
        missing = str(exc).startswith("missing label")
        return SampleProblem(f"{label_key} reads no label from {where}: {exc}{json_fields}", missing)
    image_key = f"data.image_key={options.image_key}" if options.image_key else "data.image_key (unset)"
    try:
        field_name, data = decoder.image_bytes(sample)
    except SampleError as exc:
        return SampleProblem(f"{image_key} reads no image from {where}: {exc}", True)
    if options.crop and image_extension(field_name) == "raw":
        return SampleProblem(
            f"data.train_crop=random_resized crops encoded images (jpg, png, ...), but {field_name} in "
            f"{where} holds raw pixels, which carry no image size to crop from: set "
            "data.train_crop=pad_crop, or use shards of encoded images",
            False,
        )
    try:
        if options.crop or manifest.image_size is None:
            # Images of any size: their header says they are images with a size,
            # which is what the crops start from.
            read_image_shape(sample, options.image_key)
        else:
            decoder.decode_image(field_name, data)
    except SampleError as exc:
        # The key found the field: this sample is bad data, not a wrong key.
        return SampleProblem(f"{field_name} in {where}: {exc}", False)
    return None


def _json_fields(sample: Mapping, label_key: str) -> str:
    """The top-level fields of the sample's json member, for a json:<field> label key that missed."""
    if not label_key.startswith("json:") or "json" not in sample:
        return ""
    try:
        document = json.loads(sample["json"])
    except ValueError:
        return ""
    if not isinstance(document, dict):
        return ""
    return f"; its json's fields: {', '.join(sorted(document)) or 'none'}"
