"""Per-shard sample counts that other tools recorded in metadata files beside the shards.

Each format below was read from the upstream code that writes or reads it:

- wids shard index (webdataset; `wids/wids_index.py` main_create writes it,
  `wids/wids_specs.py` resolve_dsdesc/urlmerge and `wids/wids.py`
  ShardListDataset read it; branch v0.x, removed from webdataset's main branch
  in a52927f). A JSON file anywhere, given explicitly:
  ``{"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": ...,
  "shardlist": [{"url", "nsamples", "md5sum", "filesize"}, ...],
  "datasets": [{"source_url"} | {"shardlist", "base"}, ...]}``. Shard URLs are
  resolved against the folder of the index's own URL (urlmerge: a relative path
  is joined and normalised, an absolute path keeps the index's scheme and
  bucket, a full URL stays as it is); wids ignores a top-level "base" key.
- open_clip (`src/open_clip_train/data.py`, formerly `src/training/data.py`,
  get_dataset_size): ``sizes.json`` maps a shard's file name to its count
  (open_clip applies int(), so "1000" counts too); ``__len__`` holds only the
  total, a Python literal read with ast.literal_eval. open_clip looks only in
  the folder of the first shard; we look in each shard's folder.
- timm (`timm/data/readers/reader_wds.py`, _load_info/_parse_split_info):
  ``_info.json`` then ``info.json`` (older timm: ``info.yaml``), holding
  ``splits.<name>.{name, num_samples, filenames, shard_lengths}``; the i-th
  length belongs to the i-th file name, a path relative to the info's folder.
  timm takes a split's shards from ``filenames``; a split without them has no
  per-shard counts (timm itself then needs the count in the split spec).
- img2dataset (`img2dataset/logger.py` write_stats, `img2dataset/writer.py`
  WebDatasetSampleWriter, `img2dataset/downloader.py`): ``<shard>_stats.json``
  beside ``<shard>.tar`` with ``count`` (input rows), ``successes``,
  ``failed_to_download``, ``failed_to_resize``. Only successful samples are
  written to the tar (failures go to the .parquet only), so the tar holds
  ``successes`` samples. The stats file is written after the tar is closed, so
  a shard without one may be incomplete: it is left uncovered.
"""

from __future__ import annotations

import ast
import json
import logging
import posixpath
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse, urlunparse

from tpustream import storage
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

WIDS_KIND = "wids-shard-index-v1"
WIDS_VERSION = 1
OPEN_CLIP_SIZES_NAME = "sizes.json"
OPEN_CLIP_TOTAL_NAME = "__len__"
# timm tries these in order and uses the first it finds.
TIMM_INFO_NAMES = ("_info.json", "info.json", "_info.yaml", "info.yaml")
IMG2DATASET_STATS_SUFFIX = "_stats.json"
# Stats files are one small object per shard: read this many at once so that
# thousands of them on GCS cost seconds of round-trips, not minutes.
READ_THREADS = 16


@dataclass(frozen=True)
class CountSource:
    """Sample counts from one tool's metadata in one place."""

    description: str  # one line for logs: the tool and the file or folder
    counts: dict[str, int]  # shard URL -> samples, only for shards this source covers


def read_shard_list(url: str) -> tuple[list[tuple[str, int | None]], str] | None:
    """The shards and counts a wids shard index lists, with a description for logs.

    Shard URLs are resolved as wids resolves them (see the module docstring).
    A shard whose "nsamples" is absent or null gets None: wids itself requires
    the count, but the list is still usable when the count comes from elsewhere.
    Returns None for JSON of another kind; raises ConfigError naming the file
    when it cannot be read, is not JSON, or is a malformed wids index.
    """
    index_url = storage.absolute(url)
    try:
        doc = _read_document(index_url)
    except StorageError as exc:
        raise ConfigError(f"cannot read the shard list {index_url} ({exc})") from exc
    if not _is_wids_index(doc):
        return None
    shards = _resolve_wids_index(doc, index_url)
    name = doc.get("name")
    named = f" (dataset {name!r})" if isinstance(name, str) and name else ""
    return shards, f"wids index {index_url}{named}"


def find_recorded_counts(urls: Sequence[str]) -> list[CountSource]:
    """Counts recorded beside `urls` by open_clip, timm and img2dataset, in that order of preference.

    Each distinct folder of `urls` is listed once, and only the metadata files
    the listing shows are read (img2dataset's only for shards in `urls`). A
    source covers only shards of `urls`; it is returned even when it covers
    none, so the log can say a file was found but did not match. A folder that
    cannot be listed (an http(s) URL, or no list permission) is skipped with a
    warning: the caller counts those shards itself. Wids indexes are not looked
    for: they live anywhere and are given explicitly (read_shard_list).
    Raises ConfigError naming a metadata file that is malformed, StorageError
    when a file the listing showed cannot be read.
    """
    members_by_folder: dict[str, dict[str, str]] = {}
    for url in urls:
        folder, name = _split_url(url)
        members_by_folder.setdefault(folder, {})[name] = url
    listings = {}
    for folder in members_by_folder:
        names = _list_folder(folder)
        if names is not None:
            listings[folder] = names

    readers = (_read_open_clip_sizes, _read_timm_info, _read_img2dataset_stats)
    sources = []
    for read_source in readers:
        for folder, names in listings.items():
            source = read_source(folder, members_by_folder[folder], names)
            if source is not None:
                sources.append(source)
    return sources


def read_total_hint(folder: str) -> int | None:
    """The total that open_clip's `__len__` in `folder` records, or None without one.

    A total cannot plan an epoch per shard, but it can check a sum of counts.
    """
    url = storage.join(folder, OPEN_CLIP_TOTAL_NAME)
    if not storage.exists(url):
        return None
    data = storage.read_bytes(url)
    # open_clip reads it with ast.literal_eval (it used eval before).
    try:
        value = ast.literal_eval(data.decode("utf-8-sig").strip())
    except (UnicodeDecodeError, ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise ConfigError(f"{url}: not a Python number literal ({exc.__class__.__name__})") from exc
    return _check_count(value, url, "the total")


def _resolve_wids_index(doc: dict, index_url: str) -> list[tuple[str, int | None]]:
    """The shard list of a wids index, with the checks that wids' resolve_dsdesc asserts."""
    kind = doc.get("__kind__", WIDS_KIND)
    if kind != WIDS_KIND:
        raise ConfigError(f"{index_url}: __kind__ is {_show(kind)}; the wids index kind is {WIDS_KIND!r}")
    version = doc.get("wids_version")
    if not _is_whole_number(version) or version != WIDS_VERSION:
        raise ConfigError(
            f"{index_url}: wids_version is {_show(version)}; wids reads only version {WIDS_VERSION}"
        )
    shards = _read_wids_shardlist(doc.get("shardlist", []), _wids_folder(index_url), index_url, "shardlist")

    components = doc.get("datasets", [])
    if not isinstance(components, list):
        raise ConfigError(f"{index_url}: 'datasets' is {_type_name(components)}, expected a list")
    for position, component in enumerate(components):
        where, file_url, source_url = f"datasets[{position}]", index_url, None
        if not isinstance(component, dict):
            raise ConfigError(f"{index_url}: {where} is {_type_name(component)}, expected an object")
        if "source_url" in component:
            source_url = component["source_url"]
            if not isinstance(source_url, str) or not source_url:
                raise ConfigError(f"{index_url}: {where}.source_url is {_show(source_url)}, expected a URL")
            # wids opens source_url as given: relative to the working directory.
            source_url = file_url = storage.absolute(source_url)
            try:
                component = _read_document(source_url)
            except StorageError as exc:
                raise ConfigError(f"{index_url}: cannot read {where}.source_url ({exc})") from exc
            if not isinstance(component, dict):
                raise ConfigError(f"{source_url}: {_type_name(component)}, expected a wids dataset object")
            if "source_url" in component:
                raise ConfigError(f"{source_url}: has a source_url of its own (wids allows one indirection)")
            where = "shardlist"
        if "shardlist" not in component:
            raise ConfigError(f"{file_url}: {where} has no 'shardlist'")
        base = component.get("base", _wids_folder(source_url) if source_url else None)
        if base is not None and not isinstance(base, str):
            raise ConfigError(f"{file_url}: 'base' is {_show(base)}, expected a URL")
        shards += _read_wids_shardlist(component["shardlist"], base, file_url, where)
    if not shards:
        raise ConfigError(f"{index_url}: the wids index lists no shards")
    return shards


def _read_wids_shardlist(
    entries: object, base: str | None, file_url: str, where: str
) -> list[tuple[str, int | None]]:
    if not isinstance(entries, list):
        raise ConfigError(f"{file_url}: {where} is {_type_name(entries)}, expected a list of shards")
    shards = []
    for position, entry in enumerate(entries):
        url = entry.get("url") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not url:
            raise ConfigError(f"{file_url}: {where}[{position}] has no 'url' string")
        nsamples = entry.get("nsamples")
        count = (
            None if nsamples is None else _check_count(nsamples, file_url, f"{where}[{position}].nsamples")
        )
        # Without a base wids leaves the URL as it is, relative to the working directory.
        resolved = _merge_wids_url(base, url) if base is not None else storage.absolute(url)
        shards.append((resolved, count))
    return shards


def _merge_wids_url(base: str, url: str) -> str:
    """`url` resolved against the folder URL `base` as wids' urlmerge does.

    Scheme and host come from `url` when it has them, else from `base`; an
    absolute path replaces the base path, a relative one is joined to it and
    normalised (so "../x.tar" climbs out of the index's folder).
    """
    parsed_base, parsed = urlparse(base), urlparse(url)
    if parsed.path.startswith("/"):
        path = parsed.path
    else:
        path = posixpath.normpath(posixpath.join(parsed_base.path, parsed.path))
    return urlunparse(
        (
            parsed.scheme or parsed_base.scheme,
            parsed.netloc or parsed_base.netloc,
            path,
            parsed.params,
            parsed.query,
            parsed.fragment,
        )
    )


def _wids_folder(url: str) -> str:
    """The folder of a URL as wids' urldir computes it."""
    parsed = urlparse(url)
    return parsed._replace(path=posixpath.dirname(parsed.path)).geturl()


def _is_wids_index(doc: object) -> bool:
    if not isinstance(doc, dict):
        return False
    kind = doc.get("__kind__")
    return (isinstance(kind, str) and kind.startswith("wids")) or "wids_version" in doc or "shardlist" in doc


def _read_open_clip_sizes(folder: str, members: dict[str, str], names: set[str]) -> CountSource | None:
    if OPEN_CLIP_SIZES_NAME not in names:
        return None
    file_url = storage.join(folder, OPEN_CLIP_SIZES_NAME)
    doc = _read_document(file_url)
    if not isinstance(doc, dict):
        raise ConfigError(f"{file_url}: {_type_name(doc)}, expected an object from shard file name to count")
    # Every entry is checked, not only ours: one bad count means the file cannot be trusted.
    sizes = {name: _check_count(value, file_url, repr(name), allow_text=True) for name, value in doc.items()}
    counts = {url: sizes[name] for name, url in members.items() if name in sizes}
    return CountSource(f"{OPEN_CLIP_SIZES_NAME} (open_clip) in {folder or '.'}", counts)


def _read_timm_info(folder: str, members: dict[str, str], names: set[str]) -> CountSource | None:
    info_name = next((name for name in TIMM_INFO_NAMES if name in names), None)
    if info_name is None:
        return None
    file_url = storage.join(folder, info_name)
    doc = _read_document(file_url)
    if not isinstance(doc, dict) or "splits" not in doc:
        return None  # "info.json" is a common name: without splits it is some other tool's
    splits = doc["splits"]
    if not isinstance(splits, dict):
        raise ConfigError(f"{file_url}: 'splits' is {_type_name(splits)}, expected an object of splits")
    lengths_by_split = {}
    for split_name, split in splits.items():
        lengths = _read_timm_split(split, file_url, f"splits.{split_name}")
        if lengths is not None:
            lengths_by_split[split_name] = lengths

    # Splits normally list disjoint files; should two list the same file, the
    # split that lists most of these shards is the one the run is reading.
    ranked = sorted(lengths_by_split.items(), key=lambda item: -len(item[1].keys() & members.keys()))
    counts: dict[str, int] = {}
    used = []
    for split_name, lengths in ranked:
        covered = {
            url: lengths[name] for name, url in members.items() if name in lengths and url not in counts
        }
        if covered:
            counts.update(covered)
            used.append(str(split_name))
    splits_note = f", split {', '.join(used)}" if used else ""
    return CountSource(f"{info_name} (timm) in {folder or '.'}{splits_note}", counts)


def _read_timm_split(split: object, file_url: str, where: str) -> dict[str, int] | None:
    """File name -> count of one timm split; None when the split lists no files or no lengths."""
    if not isinstance(split, dict):
        raise ConfigError(f"{file_url}: {where} is {_type_name(split)}, expected an object")
    filenames, lengths = split.get("filenames"), split.get("shard_lengths")
    if filenames is None or lengths is None:
        return None
    if not isinstance(filenames, list) or not all(isinstance(name, str) and name for name in filenames):
        raise ConfigError(f"{file_url}: {where}.filenames is not a list of file names")
    if not isinstance(lengths, list):
        raise ConfigError(f"{file_url}: {where}.shard_lengths is {_type_name(lengths)}, expected a list")
    if len(lengths) != len(filenames):
        # timm zips the two lists, so a length mismatch would silently misattribute counts.
        raise ConfigError(
            f"{file_url}: {where} has {len(filenames)} filenames but {len(lengths)} shard_lengths"
        )
    counts = [
        _check_count(value, file_url, f"{where}.shard_lengths[{position}]")
        for position, value in enumerate(lengths)
    ]
    total = split.get("num_samples")
    if total is not None and _check_count(total, file_url, f"{where}.num_samples") != sum(counts):
        raise ConfigError(
            f"{file_url}: {where}.num_samples is {total} but its shard_lengths sum to {sum(counts)}"
        )
    by_name: dict[str, int] = {}
    for name, count in zip(filenames, counts, strict=True):
        if by_name.setdefault(name, count) != count:
            raise ConfigError(f"{file_url}: {where} lists {name!r} twice with different lengths")
    return by_name


def _read_img2dataset_stats(folder: str, members: dict[str, str], names: set[str]) -> CountSource | None:
    stats_urls = {}
    for name, url in members.items():
        if name.endswith(".tar") and name[: -len(".tar")] + IMG2DATASET_STATS_SUFFIX in names:
            stats_urls[url] = storage.join(folder, name[: -len(".tar")] + IMG2DATASET_STATS_SUFFIX)
    if not stats_urls:
        return None
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(stats_urls))) as pool:
        # map() yields in order, so the first bad file in shard order is the one reported.
        counts = dict(
            zip(stats_urls, pool.map(_read_img2dataset_successes, stats_urls.values()), strict=True)
        )
    return CountSource(
        f"img2dataset *{IMG2DATASET_STATS_SUFFIX} ({len(counts)} shards) in {folder or '.'}", counts
    )


def _read_img2dataset_successes(stats_url: str) -> int:
    doc = _read_document(stats_url)
    if not isinstance(doc, dict) or "successes" not in doc:
        raise ConfigError(f"{stats_url}: no 'successes' count; not an img2dataset stats file")
    successes = _check_count(doc["successes"], stats_url, "successes")
    if "count" in doc and successes > _check_count(doc["count"], stats_url, "count"):
        raise ConfigError(f"{stats_url}: successes ({successes}) exceed count ({doc['count']})")
    return successes


def _list_folder(folder: str) -> set[str] | None:
    try:
        return set(storage.list_names(folder or "."))
    except StorageError as exc:
        log.warning("not looking for recorded sample counts in %s: cannot list it (%s)", folder or ".", exc)
        return None


def _split_url(url: str) -> tuple[str, str]:
    """(folder, file name) of a shard URL; the folder is "" for a bare relative file name."""
    folder = storage.dirname(url)
    return folder, url[len(folder) :].lstrip("/")


def _read_document(url: str) -> object:
    """A JSON (or, by its suffix, YAML) file parsed; ConfigError naming it when it does not parse."""
    data = storage.read_bytes(url)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{url}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if url.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{url}: not valid YAML ({' '.join(str(exc).split())})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{url}: not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise ConfigError(f"{url}: JSON nested too deeply to be metadata") from exc


def _check_count(value: object, file_url: str, field: str, allow_text: bool = False) -> int:
    if allow_text and isinstance(value, str) and value.strip().isdecimal():
        value = int(value)
    if not _is_whole_number(value):
        raise ConfigError(f"{file_url}: {field} is {_show(value)}, expected a sample count (a whole number)")
    if value < 0:
        raise ConfigError(f"{file_url}: {field} is {value}, a negative sample count")
    return value


def _is_whole_number(value: object) -> bool:
    # bool is an int subclass: JSON true must not read as a count of 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
