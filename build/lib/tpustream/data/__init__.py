"""The input pipeline, one subpackage per lifecycle, each using only the leaf ``format``:

- ``format``: what is on storage (the manifest, tar shards and their gzip
  stream, the index file, a sample's image and label fields, pixel modes);
- ``write``: writing shards (``tpustream-make-shards``: the command, the
  writer, the sources it converts);
- ``resolve``: once per job, before any replica starts: a shard specification
  to a split with a count per shard (``spec``, ``recorded`` counts of other
  tools, our ``counting`` and its ``tpustream-index`` command, the ``probe``
  of classes, image shape and first samples);
- ``read``: every epoch, in every replica: the epoch ``plan``, the
  ``splitters``, the ``stages`` (and the user's), decoding with ``crops``
  and ``augment``, the in-``memory`` source, the ``stream`` and its ``loader``.

shards -> counts (resolve) -> plan -> read -> decode/crop -> batch (read) -> device (training).
"""
