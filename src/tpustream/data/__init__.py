"""The input pipeline: manifests, splitting, tar reading, decoding, augmentation, loading."""
