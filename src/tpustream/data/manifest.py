"""Shard manifests: which shards a split has and how many samples each holds.

Every replica computes its steps per epoch from the manifest alone, so all
replicas agree on the number of all-reduces without talking to each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import braceexpand

from tpustream import storage
from tpustream.errors import ConfigError, StorageError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "tpustream.manifest/1"
IMAGE_FORMATS = ("png", "jpg", "raw")


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard: its URL and the number of samples in it."""

    url: str
    samples: int


@dataclass
class ShardManifest:
    """A split's shards, sample counts, classes and image geometry."""

    split: str
    classes: list[str]
    image_size: tuple[int, int]  # (height, width)
    channels: int
    image_format: str
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_classes(self) -> int:
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
            "image_size": list(self.image_size),
            "channels": self.channels,
            "image_format": self.image_format,
            "shards": shards,
        }
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, base_url: str, source: str) -> ShardManifest:
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
                image_size=(int(doc["image_size"][0]), int(doc["image_size"][1])),
                channels=int(doc["channels"]),
                image_format=str(doc["image_format"]),
                shards=shards,
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
        return asdict(self)


_BRACE = re.compile(r"\{[^}]*\.\.[^}]*\}|\{[^}]*,[^}]*\}")


def load_manifest(spec: str) -> ShardManifest:
    """Load a split from a folder/prefix holding manifest.json, or from a brace pattern.

    A brace pattern (``gs://b/cifar/train/train-{000000..000639}.tar``) selects
    shards out of the manifest.json that sits beside them, so a run can use a
    subset of a split while the sample counts still come from the manifest.
    """
    spec = storage.absolute(spec.strip())
    if not spec:
        raise ConfigError("empty shard specification")
    if spec.endswith(".json"):
        manifest_url, pattern = spec, None
    elif _BRACE.search(spec) or spec.endswith(".tar"):
        manifest_url, pattern = storage.join(storage.dirname(spec), MANIFEST_NAME), spec
    else:
        manifest_url, pattern = storage.join(spec, MANIFEST_NAME), None
    base = storage.dirname(manifest_url)
    try:
        text = storage.read_bytes(manifest_url).decode("utf-8")
    except StorageError as exc:
        raise ConfigError(
            f"no shard manifest at {manifest_url} ({exc}); "
            "write shards with `tpustream-make-shards` or point data paths at its output"
        ) from exc
    manifest = ShardManifest.from_json(text, base, manifest_url)
    if pattern is not None:
        wanted = list(braceexpand.braceexpand(pattern))
        by_url = {s.url: s for s in manifest.shards}
        missing = [u for u in wanted if u not in by_url]
        if missing:
            raise ConfigError(
                f"{pattern}: {len(missing)} shard(s) not listed in {manifest_url}, first: {missing[0]}"
            )
        manifest.shards = [by_url[u] for u in wanted]
    if manifest.num_samples == 0:
        raise ConfigError(f"{spec}: the split has no samples (manifest {manifest_url})")
    return manifest
