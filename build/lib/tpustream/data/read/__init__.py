"""Reading a replica's share of a split every epoch: plan, stages, decoding, batches, the loader."""
