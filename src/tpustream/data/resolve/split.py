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

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from tpustream import storage
from tpustream.data.format.manifest import ShardInfo, ShardManifest
from tpustream.data.resolve import recorded
from tpustream.data.resolve.counting import CountsNotReady, counts_for
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.probe import check_first_samples, describe_images
from tpustream.data.resolve.shard_spec import describe_spec, expand_spec, first_duplicate
from tpustream.errors import ConfigError

log = logging.getLogger(__name__)


def load_split(spec: str | Sequence[str], split: str, options: SplitOptions | None = None) -> ShardManifest:
    """The split described by `spec`, with a sample count for every shard; ConfigError if impossible."""
    options = options or SplitOptions()
    expanded = expand_spec(spec)
    if not expanded.urls:
        raise ConfigError(f"{describe_spec(spec)}: names no shards")
    duplicate = first_duplicate(expanded.urls)
    if duplicate:
        raise ConfigError(f"{describe_spec(spec)}: shard {duplicate} is named twice")
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
            missing,
            options.output_dir,
            allow_counting=options.allow_counting,
            counting_host=options.counting_host,
            progress=options.progress,
        )
        counts.update(found)
        sources.append(note)
    shards = [ShardInfo(u, counts[u]) for u in expanded.urls]
    _check_total_hints(expanded.whole_folders, shards)
    manifest = describe_images(spec, split, shards, expanded.manifests, options)
    manifest.counts_from = "; ".join(sources)
    if manifest.num_samples == 0:
        raise ConfigError(f"{describe_spec(spec)}: the split has no samples ({manifest.counts_from})")
    if options.label_key is not None:
        check_first_samples(manifest, options, describe_spec(spec))
    return manifest


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


# Seconds between two looks for the counting process's index.
INDEX_POLL_SECONDS = 5.0


def load_split_counted_elsewhere(
    spec: str | Sequence[str],
    split: str,
    options: SplitOptions,
    counter: str,
    wait_seconds: float,
    between_polls: Callable[[], None] = lambda: None,
    sleep: Callable[[float], None] = time.sleep,
) -> ShardManifest:
    """load_split as a process that may not count: it waits for ``counter``'s index of what has no count.

    counter names the one process that counts (a pod's host 0, a loop's rank 0),
    in the log line and in the error after ``wait_seconds``; between_polls runs
    between two looks (a stop request raises there).
    """
    options = dataclasses.replace(options, counting_host=False)
    deadline = time.monotonic() + wait_seconds
    waiting = None
    while True:
        try:
            manifest = load_split(spec, split, options)
        except CountsNotReady as exc:
            if waiting is None:
                log.info("%s: waiting for %s to index the shards", exc.folder, counter)
            waiting = exc
        else:
            if waiting is not None:
                manifest.counts_from += f" (written by {counter})"
            return manifest
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{waiting.folder}: {counter} wrote no index covering these shards within "
                f"{wait_seconds:.0f} s; run `tpustream-index {waiting.folder}` once before the job"
            )
        sleep(INDEX_POLL_SECONDS)
        between_polls()


def load_manifest(spec: str | Sequence[str], num_classes: int | None = None) -> ShardManifest:
    """A split from any shard specification, counting nothing: every count must be recorded somewhere.

    Counts come, per shard, from the first of: our ``manifest.json``, a wids
    index given as the specification, what other tools recorded beside the
    shards (open_clip's ``sizes.json``, timm's ``_info.json``, img2dataset's
    ``*_stats.json``), our ``tpustream-index.json`` (``tpustream-index`` writes
    it). Classes and image size come from our manifest, else from
    ``num_classes`` and the first sample. This is the read-only form of what
    ``train.py`` does before its replicas start; it writes nothing.

    Args:
        spec: a folder or ``gs://`` prefix (its ``*.tar``, ``*.tar.gz``, ``*.tgz``,
            or what its ``manifest.json`` lists), a brace pattern
            (``"gs://B/train-{000000..000639}.tar"``), an index file, or a list of these.
        num_classes: how many classes, for shards without our manifest (as
            ``data.num_classes``); with one, None or the manifest's count.

    Raises:
        ConfigError: the specification names no shards or a shard twice, a shard
            has no recorded count (run ``tpustream-index`` on it), or shards
            without our manifest are given no ``num_classes``.
    """
    options = SplitOptions(num_classes=num_classes, allow_counting=False, progress=False)
    return load_split(spec, "", options)
