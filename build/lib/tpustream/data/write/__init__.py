"""Writing a split's WebDataset shards and manifest (``tpustream-make-shards``)."""
