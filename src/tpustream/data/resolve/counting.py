"""The shard index: sample counts we counted ourselves, remembered for the next run.

When nothing beside the shards records how many samples each holds, every
shard is read once (in parallel, nothing decoded) and the counts are written to
``tpustream-index.json``, beside the shards when that location is writable,
else under ``<output_dir>/shard-index/``. Each entry keeps the shard's size and
version (GCS generation, local mtime), so a shard rewritten since is counted
again, and the run says so, instead of trusting a stale count that would
desynchronise the replicas' step counts.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from tpustream import storage
from tpustream.data.format.index_file import INDEX_NAME, IndexEntry, format_index, parse_index
from tpustream.data.format.tar import count_shard_samples, open_tar_stream
from tpustream.errors import ConfigError, StorageError, TpustreamError
from tpustream.preemption import StoppedBeforeStart, raise_if_stop_requested

log = logging.getLogger(__name__)

# Subfolder of output_dir for indexes of shard folders we cannot write to.
OUTPUT_INDEX_FOLDER = "shard-index"
# Shards read at once while counting: enough to hide GCS request latency,
# few enough that the read-ahead buffers (8 MiB each) stay small.
COUNT_THREADS = 16


@dataclass
class IndexRate:
    """What counting cost: for the log line and the benchmark."""

    shards: int
    bytes: int
    seconds: float

    def describe(self) -> str:
        seconds = max(self.seconds, 1e-9)
        return (
            f"{self.shards} shard(s), {self.bytes / 1e6:.1f} MB in {self.seconds:.1f} s "
            f"({self.shards / seconds:.1f} shards/s, {self.bytes / 1e6 / seconds:.1f} MB/s)"
        )


def index_urls(folder: str, output_dir: str | None) -> list[str]:
    """Where an index of the shards in `folder` may be, in order of preference."""
    urls = [storage.join(folder, INDEX_NAME)] if storage.has_neighbours(folder) else []
    if output_dir:
        digest = hashlib.sha1(folder.encode()).hexdigest()[:16]
        urls.append(storage.join(output_dir, OUTPUT_INDEX_FOLDER, f"{digest}.json"))
    return urls


def read_index(folder: str, output_dir: str | None) -> tuple[str | None, dict[str, IndexEntry]]:
    """The first index of `folder` found (its URL and entries), or (None, {})."""
    for url in index_urls(folder, output_dir):
        try:
            text = storage.read_bytes(url)
        except StorageError:
            continue
        _, entries = parse_index(text, url)
        return url, entries
    return None, {}


def count_shard(url: str) -> tuple[int, int]:
    """(samples, stored bytes) of one shard, read once without decoding anything."""
    with storage.open_read(url) as raw:
        counted = _CountingReader(raw)
        with open_tar_stream(counted, url) as stream:
            return count_shard_samples(stream, url), counted.bytes


class _CountingReader:
    """Counts the stored (possibly compressed) bytes a reader pulls, for the indexing rate."""

    def __init__(self, raw):
        self._raw = raw
        self.bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.bytes += len(data)
        return data

    def close(self) -> None:
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def count_shards(
    urls: Sequence[str], progress: bool = True, threads: int = COUNT_THREADS
) -> tuple[dict[str, IndexEntry], IndexRate]:
    """Count every shard in parallel, recording each one's size and version.

    The stat comes first: a shard replaced while it is counted then fails the
    next run's check and is counted again, never the other way round. A shard
    that cannot be stat'ed (pipe:, http without ETag) gets version "", which
    the check cannot verify and trusts (the loader still catches a count that lies).
    """
    started = time.perf_counter()

    def one(url: str) -> tuple[str, IndexEntry, int]:
        stat = _stat_or_none(url)
        samples, stored = count_shard(url)
        entry = IndexEntry(samples, stat.size, stat.version) if stat else IndexEntry(samples, -1, "")
        return url, entry, stored

    entries: dict[str, IndexEntry] = {}
    total_bytes = 0
    bar = tqdm(total=len(urls), desc="counting samples", unit="shard", disable=not progress)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        try:
            for url, entry, stored in pool.map(one, urls):
                entries[url] = entry
                total_bytes += stored
                bar.update(1)
                bar.set_postfix_str(f"{total_bytes / 1e6:.0f} MB", refresh=False)
                # Counting a large bucket takes minutes: a stop request ends it (and the run) here.
                raise_if_stop_requested(f"while counting samples ({len(entries)} of {len(urls)} shards)")
        except (TpustreamError, StoppedBeforeStart):
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            bar.close()
    return entries, IndexRate(len(urls), total_bytes, time.perf_counter() - started)


def stale_entries(entries: dict[str, IndexEntry], urls: Sequence[str]) -> list[str]:
    """URLs among `urls` whose indexed size or version differs from the shard's now."""
    stale = []
    with ThreadPoolExecutor(max_workers=max(1, min(COUNT_THREADS, len(urls)))) as pool:
        for url, stat in zip(urls, pool.map(_stat_or_none, urls), strict=True):
            entry = entries[url]
            if entry.version == "":
                continue  # recorded without a version: nothing to compare
            if stat is None or (stat.size, stat.version) != (entry.size, entry.version):
                stale.append(url)
    return stale


def _stat_or_none(url: str) -> storage.ObjectStat | None:
    try:
        return storage.stat(url)
    except StorageError:
        return None


def write_index(folder: str, entries: dict[str, IndexEntry], output_dir: str | None) -> str | None:
    """Save the index beside the shards, else in output_dir; its URL, or None if neither is writable."""
    data = format_index(folder, entries)
    reasons = []
    for url in index_urls(folder, output_dir):
        try:
            storage.write_bytes(url, data)
            return url
        except StorageError as exc:
            reasons.append(str(exc))
    log.warning(
        "could not save the shard index of %s (%s); the next run counts again", folder, "; ".join(reasons)
    )
    return None


def group_by_folder(urls: Sequence[str]) -> dict[str, list[str]]:
    """URLs by the folder they are in (an index describes one folder), in order."""
    by_folder: dict[str, list[str]] = {}
    for url in urls:
        by_folder.setdefault(storage.dirname(url), []).append(url)
    return by_folder


def shards_to_count(entries: dict[str, IndexEntry], urls: Sequence[str]) -> tuple[list[str], list[str]]:
    """(missing, stale): the shards of urls the index lacks, and those changed since they were counted."""
    known = [u for u in urls if u in entries]
    return [u for u in urls if u not in entries], (stale_entries(entries, known) if known else [])


def count_into_index(
    folder: str,
    entries: dict[str, IndexEntry],
    todo: Sequence[str],
    output_dir: str | None,
    progress: bool = True,
    threads: int = COUNT_THREADS,
) -> tuple[str | None, IndexRate]:
    """Count `todo`, update `entries` with them and save the folder's index: (its URL or None, the rate)."""
    counted, rate = count_shards(todo, progress=progress, threads=threads)
    entries.update(counted)
    return write_index(folder, entries, output_dir), rate


class CountsNotReady(ConfigError):
    """Shards without a count where this process may not count them (a pod host other than the first).

    split.load_split_counted_elsewhere catches it and waits for the one that counts to write the index.
    """

    def __init__(self, folder: str, missing: int):
        super().__init__(f"{folder}: {missing} shard(s) not counted yet; pod host 0 counts them")
        self.folder = folder


def counts_for(
    urls: Sequence[str],
    output_dir: str | None,
    *,
    allow_counting: bool,
    counting_host: bool = True,
    progress: bool = True,
) -> tuple[dict[str, int], str]:
    """Sample counts of `urls` from their index, counting what is missing or stale.

    Returns (url -> samples, a one-line description of where they came from).
    Only a counting host counts (one per pod, so every host plans the epoch
    from the same counts); elsewhere missing counts raise CountsNotReady.
    """
    counts: dict[str, int] = {}
    notes = []
    for folder, members in group_by_folder(urls).items():
        found, note = _folder_counts(folder, members, output_dir, allow_counting, counting_host, progress)
        counts.update(found)
        notes.append(note)
    return counts, "; ".join(notes)


def _folder_counts(
    folder: str,
    urls: list[str],
    output_dir: str | None,
    allow_counting: bool,
    counting_host: bool,
    progress: bool,
) -> tuple[dict[str, int], str]:
    index_url, entries = read_index(folder, output_dir)
    missing, stale = shards_to_count(entries, urls)
    if not stale and not missing:
        return {u: entries[u].samples for u in urls}, f"index {index_url}"
    todo = missing + stale
    if not allow_counting:
        raise ConfigError(
            f"{folder}: no sample count for {len(todo)} shard(s) (first: {todo[0]}); run "
            f"`tpustream-index {folder}` or set data.index=auto to count them at start"
        )
    if not counting_host:
        raise CountsNotReady(folder, len(todo))
    if stale:
        log.warning(
            "%s: %d shard(s) changed since they were indexed (first: %s); counting them again",
            index_url,
            len(stale),
            stale[0],
        )
    saved, rate = count_into_index(folder, entries, todo, output_dir, progress=progress)
    log.info("counted %s; index %s", rate.describe(), saved or "not saved")
    return {u: entries[u].samples for u in urls}, f"counted now ({saved or 'index not saved'})"
