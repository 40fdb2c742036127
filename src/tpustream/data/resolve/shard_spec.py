"""A shard specification to its shard URLs, with the counts the specification itself carries.

A specification is a folder or gs:// prefix, a brace pattern, a list of
patterns (a Hydra list), or an index file (our manifest.json, a wids shard
index, our tpustream-index.json).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import braceexpand

from tpustream import storage
from tpustream.data.format.index_file import INDEX_FORMAT, parse_index
from tpustream.data.format.manifest import MANIFEST_FORMAT, MANIFEST_NAME, ShardManifest
from tpustream.data.resolve import recorded
from tpustream.data.resolve.counting import stale_entries
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

# What a shard's name ends with (webdataset reads the same; .gz is gunzipped while streaming).
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_BRACE = re.compile(r"\{[^}]*\.\.[^}]*\}|\{[^}]*,[^}]*\}")


@dataclass
class Expanded:
    urls: list[str]
    counts: dict[str, int]  # known so far
    manifests: list[ShardManifest]
    whole_folders: list[str] = field(default_factory=list)  # named whole, without a manifest
    sources: list[str] = field(default_factory=list)  # where the counts above came from, for the log


def expand_spec(spec: str | Sequence[str]) -> Expanded:
    """Shard URLs of a specification, with the counts it carries itself (manifests, index files)."""
    if not isinstance(spec, str):
        out = Expanded([], {}, [])
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


def _expand_pattern(pattern: str) -> Expanded:
    """Brace-expanded URLs; counts from the manifest beside them when there is one."""
    urls = list(braceexpand.braceexpand(pattern))
    if not storage.has_neighbours(urls[0]):
        return Expanded(urls, {}, [])
    manifest_url = storage.join(storage.dirname(urls[0]), MANIFEST_NAME)
    manifest = _read_manifest(manifest_url)
    if manifest is None:
        return Expanded(urls, {}, [])
    listed = {s.url: s.samples for s in manifest.shards}
    outside = [u for u in urls if u not in listed]
    if outside:
        raise ConfigError(
            f"{pattern}: {len(outside)} shard(s) not listed in {manifest_url}, first: {outside[0]}"
        )
    return Expanded(urls, {u: listed[u] for u in urls}, [manifest], sources=[manifest_url])


def _expand_folder(folder: str) -> Expanded:
    """A folder with our manifest is the manifest's shards; without one, every shard file in it."""
    manifest_url = storage.join(folder, MANIFEST_NAME)
    manifest = _read_manifest(manifest_url)
    if manifest is not None:
        urls = [s.url for s in manifest.shards]
        _warn_unlisted_shards(folder, manifest_url, urls)
        return Expanded(urls, {s.url: s.samples for s in manifest.shards}, [manifest], sources=[manifest_url])
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
    return Expanded(urls, {}, [], [folder])


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


def _expand_index_file(url: str) -> Expanded:
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
        return Expanded(
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
        return Expanded(list(entries), counts, [], sources=[f"index {url}"])
    listed = recorded.read_shard_list(url)
    if listed is None:
        raise ConfigError(f"{url}: neither a tpustream manifest, a tpustream index nor a wids shard index")
    shards, description = listed
    return Expanded(
        [u for u, _ in shards], {u: n for u, n in shards if n is not None}, [], sources=[description]
    )


def _read_manifest(url: str) -> ShardManifest | None:
    """Our manifest at url, or None if there is none there."""
    try:
        text = storage.read_bytes(url)
    except StorageError:
        return None
    return ShardManifest.from_json(text.decode("utf-8"), storage.dirname(url), url)


def first_duplicate(urls: list[str]) -> str | None:
    seen: set[str] = set()
    for url in urls:
        if url in seen:
            return url
        seen.add(url)
    return None


def describe_spec(spec: str | Sequence[str]) -> str:
    return spec if isinstance(spec, str) else "[" + ", ".join(spec) + "]"
