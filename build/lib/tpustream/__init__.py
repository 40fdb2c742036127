"""tpustream: stream WebDataset shards from GCS into every core of a TPU pod."""
