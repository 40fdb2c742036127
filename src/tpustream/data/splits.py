"""A shard specification to a split every replica can plan from: URLs, counts, classes, image shape.

A specification is a folder or gs:// prefix, a brace pattern, a list of
patterns (a Hydra list), or an index file (our manifest.json, a wids shard
index, our tpustream-index.json). Counts come, per shard, from the first of:
our manifest; the index file given; what other tools recorded beside the
shards (open_clip, timm, img2dataset: ``counts``); our own index, counting
what is still missing (``index``). All of it happens once per job, before any
replica is spawned, so replicas get identical counts by construction. For
training, the first samples are also read with the configured image and label
keys, so a wrong key fails here rather than after an epoch of bad samples.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import braceexpand

from tpustream import storage
from tpustream.data import counts as recorded
from tpustream.data.crops import CroppingDecoder
from tpustream.data.decode import (
    DEFAULT_IMAGE_KEYS,
    ImageDecoder,
    SampleError,
    image_extension,
    read_image_shape,
)
from tpustream.data.index import INDEX_FORMAT, counts_for, parse_index, stale_entries
from tpustream.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME, ShardInfo, ShardManifest
from tpustream.data.tar_stream import ShardFormatError, iter_shard_samples, open_tar_stream
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

# What a shard's name ends with (webdataset reads the same; .gz is gunzipped while streaming).
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_BRACE = re.compile(r"\{[^}]*\.\.[^}]*\}|\{[^}]*,[^}]*\}")


@dataclass(frozen=True)
class SplitOptions:
    """What the data config says about a split beyond where its shards are."""

    image_key: str | None = None
    num_classes: int | None = None
    image_size: int | None = None  # square side; None = the manifest's, else the first sample's
    channels: int | None = None  # None = the manifest's, else 3
    # Images are cropped to image_size (data.train_crop=random_resized): any
    # stored size will do, and image_size is the crops' size, not the stored one.
    crop: bool = False
    # data.label_key. Set (training), the first samples are read as training
    # reads them, so a wrong image or label key fails before spawning instead
    # of after an epoch of bad samples; None (tools) reads no sample for it.
    label_key: str | None = None
    allow_counting: bool = True  # data.index=auto
    output_dir: str | None = None  # where an index goes when the shards' folder is read-only
    progress: bool = True


@dataclass
class _Expanded:
    urls: list[str]
    counts: dict[str, int]  # known so far
    manifests: list[ShardManifest]
    whole_folders: list[str] = field(default_factory=list)  # named whole, without a manifest
    sources: list[str] = field(default_factory=list)  # where the counts above came from, for the log


def load_split(spec: str | Sequence[str], split: str, options: SplitOptions | None = None) -> ShardManifest:
    """The split described by `spec`, with a sample count for every shard; ConfigError if impossible."""
    options = options or SplitOptions()
    expanded = expand_spec(spec)
    if not expanded.urls:
        raise ConfigError(f"{_describe(spec)}: names no shards")
    duplicate = _first_duplicate(expanded.urls)
    if duplicate:
        raise ConfigError(f"{_describe(spec)}: shard {duplicate} is named twice")
    counts = dict(expanded.counts)
    sources = list(dict.fromkeys(expanded.sources))
    missing = [u for u in expanded.urls if u not in counts]
    if missing:
        for source in recorded.find_recorded_counts([u for u in missing if storage.has_neighbours(u)]):
            covered = {u: n for u, n in source.counts.items() if u not in counts and u in missing}
            if covered:
                counts.update(covered)
                sources.append(source.description)
        missing = [u for u in expanded.urls if u not in counts]
    if missing:
        found, note = counts_for(
            missing, options.output_dir, allow_counting=options.allow_counting, progress=options.progress
        )
        counts.update(found)
        sources.append(note)
    shards = [ShardInfo(u, counts[u]) for u in expanded.urls]
    _check_total_hints(expanded.whole_folders, shards)
    manifest = _describe_images(spec, split, shards, expanded.manifests, options)
    manifest.counts_from = "; ".join(sources)
    if manifest.num_samples == 0:
        raise ConfigError(f"{_describe(spec)}: the split has no samples ({manifest.counts_from})")
    if options.label_key is not None:
        _check_first_samples(manifest, options, _describe(spec))
    return manifest


def expand_spec(spec: str | Sequence[str]) -> _Expanded:
    """Shard URLs of a specification, with the counts it carries itself (manifests, index files)."""
    if not isinstance(spec, str):
        out = _Expanded([], {}, [])
        for item in spec:
            if not isinstance(item, str):
                raise ConfigError(f"shard specification {item!r}: expected a string")
            part = expand_spec(item)
            out.urls += part.urls
            out.counts.update(part.counts)
            out.manifests += part.manifests
            out.whole_folders += part.whole_folders
            out.sources += part.sources
        return out
    spec = storage.absolute(spec.strip())
    if not spec:
        raise ConfigError("empty shard specification")
    if spec.endswith(".json"):
        return _expand_index_file(spec)
    if _BRACE.search(spec) or spec.endswith(SHARD_SUFFIXES):
        return _expand_pattern(spec)
    return _expand_folder(spec)


def _expand_pattern(pattern: str) -> _Expanded:
    """Brace-expanded URLs; counts from the manifest beside them when there is one."""
    urls = list(braceexpand.braceexpand(pattern))
    if not storage.has_neighbours(urls[0]):
        return _Expanded(urls, {}, [])
    manifest_url = storage.join(storage.dirname(urls[0]), MANIFEST_NAME)
    manifest = _read_manifest(manifest_url)
    if manifest is None:
        return _Expanded(urls, {}, [])
    listed = {s.url: s.samples for s in manifest.shards}
    outside = [u for u in urls if u not in listed]
    if outside:
        raise ConfigError(
            f"{pattern}: {len(outside)} shard(s) not listed in {manifest_url}, first: {outside[0]}"
        )
    return _Expanded(urls, {u: listed[u] for u in urls}, [manifest], sources=[manifest_url])


def _expand_folder(folder: str) -> _Expanded:
    """A folder with our manifest is the manifest's shards; without one, every shard file in it."""
    manifest_url = storage.join(folder, MANIFEST_NAME)
    manifest = _read_manifest(manifest_url)
    if manifest is not None:
        urls = [s.url for s in manifest.shards]
        _warn_unlisted_shards(folder, manifest_url, urls)
        return _Expanded(
            urls, {s.url: s.samples for s in manifest.shards}, [manifest], sources=[manifest_url]
        )
    try:
        names = storage.list_names(folder)
    except StorageError as exc:
        raise ConfigError(f"{folder}: cannot list the shards ({exc})") from exc
    urls = [storage.join(folder, n) for n in names if n.endswith(SHARD_SUFFIXES)]
    if not urls:
        raise ConfigError(
            f"{folder}: no shards ({', '.join('*' + s for s in SHARD_SUFFIXES)}) and no {MANIFEST_NAME}; "
            "point data.train_shards / data.val_shards at your shards (a folder, a brace pattern, "
            "a list, or an index file)"
        )
    return _Expanded(urls, {}, [], [folder])


def _warn_unlisted_shards(folder: str, manifest_url: str, listed: list[str]) -> None:
    """Warn of shard files beside a manifest that it does not list: they are not read."""
    try:
        names = storage.list_names(folder)
    except StorageError as exc:  # the manifest was readable: the split is usable without the listing
        log.debug("%s: cannot list the folder to compare it with %s (%s)", folder, manifest_url, exc)
        return
    known = set(listed)
    unlisted = [n for n in names if n.endswith(SHARD_SUFFIXES) and storage.join(folder, n) not in known]
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (", ..." if len(unlisted) > 5 else "")
        log.warning(
            "%s: %d shard file(s) in the folder are not in %s and are NOT read: %s. To read them, add them "
            "to it with their sample counts, or remove it (the folder then means every shard file in it, "
            "and data.num_classes names the classes)",
            folder,
            len(unlisted),
            MANIFEST_NAME,
            shown,
        )


def _expand_index_file(url: str) -> _Expanded:
    try:
        text = storage.read_bytes(url)
    except StorageError as exc:
        raise ConfigError(f"no shard index at {url} ({exc})") from exc
    try:
        kind = json.loads(text).get("format") if text.lstrip().startswith(b"{") else None
    except ValueError as exc:
        raise ConfigError(f"{url}: not valid JSON ({exc})") from exc
    if kind == MANIFEST_FORMAT:
        manifest = ShardManifest.from_json(text.decode("utf-8"), storage.dirname(url), url)
        return _Expanded(
            [s.url for s in manifest.shards],
            {s.url: s.samples for s in manifest.shards},
            [manifest],
            sources=[url],
        )
    if kind == INDEX_FORMAT:
        _, entries = parse_index(text, url)
        stale = set(stale_entries(entries, list(entries)))
        if stale:
            log.warning(
                "%s: %d shard(s) changed since they were indexed; counting them again", url, len(stale)
            )
        counts = {u: e.samples for u, e in entries.items() if u not in stale}
        return _Expanded(list(entries), counts, [], sources=[f"index {url}"])
    listed = recorded.read_shard_list(url)
    if listed is None:
        raise ConfigError(f"{url}: neither a tpustream manifest, a tpustream index nor a wids shard index")
    shards, description = listed
    return _Expanded(
        [u for u, _ in shards], {u: n for u, n in shards if n is not None}, [], sources=[description]
    )


def _check_total_hints(folders: list[str], shards: list[ShardInfo]) -> None:
    """open_clip's __len__ holds only a folder's total: not a plan, but a check on the counts."""
    for folder in folders:
        hint = recorded.read_total_hint(folder)
        prefix = folder.rstrip("/") + "/"
        total = sum(s.samples for s in shards if s.url.startswith(prefix))
        if hint is not None and hint != total:
            log.warning(
                "%s: open_clip's __len__ says %d samples, but the shards hold %d by their counts",
                folder,
                hint,
                total,
            )


def _read_manifest(url: str) -> ShardManifest | None:
    """Our manifest at url, or None if there is none there."""
    try:
        text = storage.read_bytes(url)
    except StorageError:
        return None
    return ShardManifest.from_json(text.decode("utf-8"), storage.dirname(url), url)


def _describe_images(
    spec: str | Sequence[str],
    split: str,
    shards: list[ShardInfo],
    manifests: list[ShardManifest],
    options: SplitOptions,
) -> ShardManifest:
    """Classes, image shape and channels: from the config, our manifest, or the first sample."""
    name = _describe(spec)
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
    return ShardManifest(
        split or (first.split if first else ""),
        classes,
        image_size,
        channels,
        image_format,
        shards,
        size_stats=first.size_stats if first else None,
    )


def _first_image_shape(
    shards: list[ShardInfo], image_key: str | None, name: str
) -> tuple[tuple[int, int], str]:
    """(height, width) and image field of the first sample that decodes, from the first non-empty shards."""
    reasons = []
    for shard in [s for s in shards if s.samples > 0][:3]:
        try:
            with storage.open_read(shard.url) as raw, open_tar_stream(raw, shard.url) as stream:
                for sample in iter_shard_samples(stream, shard.url, 0, 5):
                    try:
                        shape = read_image_shape(sample, image_key)
                    except SampleError as exc:
                        reasons.append(f"{shard.url} sample {sample['__key__']}: {exc}")
                        continue
                    keys = image_key.split(";") if image_key else DEFAULT_IMAGE_KEYS
                    return shape, next((k for k in keys if k in sample), "")
        except (StorageError, ShardFormatError) as exc:
            reasons.append(str(exc))
    first_reason = reasons[0] if reasons else "no samples"
    raise ConfigError(
        f"{name}: cannot learn the image size from the first samples ({first_reason}); set data.image_size"
    )


# Samples read to check the fields. A first sample that fails alone is bad
# data (training skips and counts it); all of them failing is the config.
_CHECKED_SAMPLES = 3


def _check_first_samples(manifest: ShardManifest, options: SplitOptions, name: str) -> None:
    """ConfigError unless one of the first samples gives an image and a label as training reads them."""
    shard = next(s for s in manifest.shards if s.samples > 0)
    # Varying sizes without cropping never train (launch.checks.check_data
    # says so); the stand-in size only lets the label be read here.
    height, width = manifest.image_size or (1, 1)
    decoder = ImageDecoder(
        manifest.channels, height, width, manifest.num_classes, options.image_key, options.label_key
    )
    first_error = None
    try:
        with storage.open_read(shard.url) as raw, open_tar_stream(raw, shard.url) as stream:
            for sample in iter_shard_samples(stream, shard.url, 0, _CHECKED_SAMPLES):
                where = f"sample {sample['__key__']} of {shard.url}"
                error = _sample_error(sample, where, decoder, manifest, options)
                if error is None:
                    return
                first_error = first_error or error
    except (StorageError, ShardFormatError) as exc:
        # Training reads the shard again and handles this under data.on_error.
        log.warning("%s: cannot read a first sample to check the image and label keys (%s)", name, exc)
        return
    if first_error is not None:
        raise ConfigError(f"{name}: {first_error}")


def _sample_error(
    sample: Mapping, where: str, decoder: ImageDecoder, manifest: ShardManifest, options: SplitOptions
) -> str | None:
    """Why training could not use this sample, naming the setting at fault; None if it could.

    A missing field's reason (SampleError's) lists the fields the sample has.
    """
    try:
        decoder.decode_label(sample)
    except SampleError as exc:
        if str(exc).startswith("label ") and " outside 0.." in str(exc):
            # The key works; the class count is what does not fit.
            return (
                f"{where} has {exc} (the split's {decoder.num_classes} classes): set data.num_classes, "
                f"or check data.label_key={options.label_key}"
            )
        json_fields = _json_fields(sample, options.label_key)
        return f"data.label_key={options.label_key} reads no label from {where}: {exc}{json_fields}"
    image_key = f"data.image_key={options.image_key}" if options.image_key else "data.image_key (unset)"
    try:
        field_name, data = decoder.image_bytes(sample)
        if options.crop and image_extension(field_name) == "raw":
            return (
                f"data.train_crop=random_resized crops encoded images (jpg, png, ...), but {field_name} in "
                f"{where} holds raw pixels, which carry no image size to crop from: set "
                "data.train_crop=pad_crop, or use shards of encoded images"
            )
        if options.crop:
            CroppingDecoder(decoder, train=False, seed=0).for_epoch(0)(sample)
        elif manifest.image_size is None:
            read_image_shape(sample, options.image_key)
        else:
            decoder.decode_image(field_name, data)
    except SampleError as exc:
        return f"{image_key} reads no image from {where}: {exc}"
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


def _first_duplicate(urls: list[str]) -> str | None:
    seen: set[str] = set()
    for url in urls:
        if url in seen:
            return url
        seen.add(url)
    return None


def _describe(spec: str | Sequence[str]) -> str:
    return spec if isinstance(spec, str) else "[" + ", ".join(spec) + "]"
