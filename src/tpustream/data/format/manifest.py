"""Shard manifests: which shards a split has and how many samples each holds.

Every replica computes its steps per epoch from the manifest alone, so all
replicas agree on the number of all-reduces without talking to each other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from tpustream import storage
from tpustream.errors import ConfigError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tpustream.manifest/1"
# mixed: original image files of several formats, each sample's under its own
# extension (jpg, png, webp, ...); decoders tell the format from the content.
IMAGE_FORMATS = ("png", "jpg", "raw", "mixed")


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard: its URL and the number of samples in it.

    Attributes:
        url: where the shard is (a local path, ``gs://``, ``http(s)://`` or ``pipe:`` URL).
        samples: the samples it holds, as counted or recorded.
    """

    url: str
    samples: int


@dataclass
class ShardManifest:
    """A split's shards, sample counts, classes and image geometry.

    What ``manifest.json`` holds (``to_json`` / ``from_json``), and what
    ``load_manifest`` gives for any shard specification.

    Attributes:
        split: the split's name (``train``, ``val``, ...).
        classes: class names; label i is ``classes[i]``.
        image_size: the stored images' (height, width); None when they vary.
        channels: image channels (3: RGB).
        image_format: ``png``, ``jpg``, ``raw`` (uint8 pixels) or ``mixed``.
        shards: the shards in order, each with its sample count.
        size_stats: the stored sizes' ``{"count", "min", "max", "mean"}``, each
            a [height, width]; None when not recorded.
    """

    split: str
    classes: list[str]
    image_size: tuple[int, int] | None  # (height, width); None: images vary in size
    channels: int
    image_format: str
    shards: list[ShardInfo] = field(default_factory=list)
    # The stored images' (height, width): {"count": n, "min": [h, w], "max": [h, w],
    # "mean": [h, w]}, min and max per dimension; None when not recorded.
    size_stats: dict | None = None
    # Where the sample counts came from, for the start-up log (not serialised).
    counts_from: str = "manifest.json"
    # Under crops (image_size is then the crops' side): the largest stored (height,
    # width), where a manifest says it, for the start-up checks (not serialised).
    stored_size: tuple[int, int] | None = None

    @property
    def num_samples(self) -> int:
        """Samples in the split: the shards' counts summed."""
        return sum(s.samples for s in self.shards)

    @property
    def num_classes(self) -> int:
        """Classes the labels index (0 .. num_classes - 1)."""
        return len(self.classes)

    def to_json(self, base_url: str) -> str:
        """Serialise with shard names relative to base_url (the manifest's folder)."""
        shards = []
        for shard in self.shards:
            name = shard.url
            prefix = base_url.rstrip("/") + "/"
            if name.startswith(prefix):
                name = name[len(prefix) :]
            shards.append({"name": name, "samples": shard.samples})
        doc = {
            "format": MANIFEST_FORMAT,
            "split": self.split,
            "num_samples": self.num_samples,
            "classes": self.classes,
            "image_size": None if self.image_size is None else list(self.image_size),
        }
        if self.size_stats is not None:
            doc["image_sizes"] = self.size_stats
        doc |= {"channels": self.channels, "image_format": self.image_format, "shards": shards}
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, base_url: str, source: str) -> ShardManifest:
        """Read a manifest.json's text; shard names are joined to base_url, source names it in errors."""
        try:
            doc = json.loads(text)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            shards = [
                ShardInfo(url=storage.join(base_url, s["name"]), samples=int(s["samples"]))
                for s in doc["shards"]
            ]
            manifest = cls(
                split=str(doc["split"]),
                classes=[str(c) for c in doc["classes"]],
                image_size=_read_image_size(doc["image_size"]),
                channels=int(doc["channels"]),
                image_format=str(doc["image_format"]),
                shards=shards,
                size_stats=_read_size_stats(doc.get("image_sizes")),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ConfigError(f"{source}: not a valid tpustream manifest ({exc})") from exc
        if manifest.image_format not in IMAGE_FORMATS:
            raise ConfigError(f"{source}: unknown image_format {manifest.image_format!r}")
        if any(s.samples < 0 for s in shards):
            raise ConfigError(f"{source}: negative sample count")
        if int(doc.get("num_samples", manifest.num_samples)) != manifest.num_samples:
            raise ConfigError(f"{source}: num_samples does not match the sum over shards")
        return manifest

    def as_dict(self) -> dict:
        """Every field as plain dicts and lists (``dataclasses.asdict``)."""
        return asdict(self)


def _read_image_size(value: list | None) -> tuple[int, int] | None:
    if value is None:
        return None
    height, width = value
    return int(height), int(width)


def _read_size_stats(value: dict | None) -> dict | None:
    """The image_sizes record, checked and normalised; None when the manifest has none."""
    if value is None:
        return None
    height, width = value["mean"]
    return {
        "count": int(value["count"]),
        "min": list(_read_image_size(value["min"])),
        "max": list(_read_image_size(value["max"])),
        "mean": [round(float(height), 1), round(float(width), 1)],
    }


def summarize_image_sizes(sizes: Iterable[tuple[int, int]]) -> dict | None:
    """A manifest's image_sizes record of (height, width) pairs; None for none."""
    heights, widths = [], []
    for height, width in sizes:
        heights.append(height)
        widths.append(width)
    if not heights:
        return None
    count = len(heights)
    return {
        "count": count,
        "min": [min(heights), min(widths)],
        "max": [max(heights), max(widths)],
        "mean": [round(sum(heights) / count, 1), round(sum(widths) / count, 1)],
    }
