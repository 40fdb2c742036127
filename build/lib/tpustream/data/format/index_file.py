"""The shard index file, ``tpustream-index.json``: per shard, its sample count, size and version.

What is on storage (the leaf both the split resolution and the index
command read and write); ``data.resolve.counting`` decides where it lives and
when a shard is counted again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tpustream import storage
from tpustream.errors import ConfigError

INDEX_NAME = "tpustream-index.json"
INDEX_FORMAT = "tpustream.index/1"


@dataclass(frozen=True)
class IndexEntry:
    """One counted shard: its count, and the size and version it had when counted."""

    samples: int
    size: int
    version: str


def parse_index(text: bytes, url: str) -> tuple[str, dict[str, IndexEntry]]:
    """(the folder the index describes, shard URL -> entry); ConfigError naming url if malformed."""
    try:
        doc = json.loads(text)
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {INDEX_FORMAT!r}")
        folder = str(doc["folder"])
        entries = {}
        for item in doc["shards"]:
            entry = IndexEntry(int(item["samples"]), int(item["size"]), str(item["version"]))
            if entry.samples < 0:
                raise ValueError(f"negative sample count for {item['name']}")
            entries[storage.join(folder, str(item["name"]))] = entry
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{url}: not a valid tpustream shard index ({exc}); delete it to recount") from exc
    return folder, entries


def format_index(folder: str, entries: dict[str, IndexEntry]) -> bytes:
    prefix = folder.rstrip("/") + "/"
    shards = [
        {"name": url.removeprefix(prefix), "samples": e.samples, "size": e.size, "version": e.version}
        for url, e in sorted(entries.items())
    ]
    doc = {"format": INDEX_FORMAT, "folder": folder, "num_samples": sum(e.samples for e in entries.values())}
    doc["shards"] = shards
    return (json.dumps(doc, indent=1) + "\n").encode()
