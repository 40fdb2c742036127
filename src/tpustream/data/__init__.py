"""The input pipeline, one subpackage per lifecycle, each using only the leaf ``format``:

- ``format``: what is on storage (the manifest, tar shards and their gzip
  stream, the index file, a sample's image and label fields, pixel modes);
- ``write``: writing shards (``tpustream-make-shards``: the command, the
  writer, the sources it converts);
- ``resolve``: once per job, before any replica starts: a shard specification
  to a split with a count per shard (``shard_spec``, ``recorded`` counts of other
  tools, our ``counting`` and its ``tpustream-index`` command, the ``probe``
  of classes, image shape and first samples);
- ``read``: every epoch, in every replica: the epoch ``layout``, the
  ``splitters``, the ``stages`` (and the user's), decoding with ``crops``
  and ``crop_flip``, the in-``memory`` source, the ``stream`` and its ``loader``.

shards -> counts (resolve) -> layout -> read -> decode/crop -> batch (read) -> device (training).

The names below are the public surface (docs/api.md): what a user may import
from ``tpustream.data`` for their own loop or tools, kept stable; every other
module may change. They are imported when first asked for, so that importing
a data module (as every DataLoader worker does) does not import them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The same imports __getattr__ makes on first use, written out so that type checkers,
    # the API page (mkdocstrings) and tests/test_layout.py's import graph see them.
    from tpustream.data.format.manifest import ShardInfo as ShardInfo
    from tpustream.data.format.manifest import ShardManifest as ShardManifest
    from tpustream.data.read.layout import EpochLayout as EpochLayout
    from tpustream.data.read.layout import plan_layout as plan_layout
    from tpustream.data.read.splitters import ReplicaSplitter as ReplicaSplitter
    from tpustream.data.read.splitters import WorkerSplitter as WorkerSplitter
    from tpustream.data.resolve.split import load_manifest as load_manifest
    from tpustream.data.shard_loader import ShardLoader as ShardLoader

# Public name -> the module that defines it.
PUBLIC = {
    "ReplicaSplitter": "tpustream.data.read.splitters",
    "WorkerSplitter": "tpustream.data.read.splitters",
    "ShardManifest": "tpustream.data.format.manifest",
    "ShardInfo": "tpustream.data.format.manifest",
    "load_manifest": "tpustream.data.resolve.split",
    "plan_layout": "tpustream.data.read.layout",
    "EpochLayout": "tpustream.data.read.layout",
    "ShardLoader": "tpustream.data.shard_loader",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'tpustream.data' has no attribute {name!r}")
    return getattr(importlib.import_module(PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])
