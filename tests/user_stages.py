"""webdataset stages that tests add through data.stages (importable by spawned DataLoader workers)."""

from __future__ import annotations

from collections.abc import Iterator


def invert(samples: Iterator[dict]) -> Iterator[dict]:
    """Negative images: 255 - pixel."""
    for sample in samples:
        sample["image"] = 255 - sample["image"]
        yield sample


def drop_label_three(samples: Iterator[dict]) -> Iterator[dict]:
    """Leave out every sample of class 3 (their places are filled, like bad data)."""
    for sample in samples:
        if sample["label"] != 3:
            yield sample


def shrink(samples: Iterator[dict]) -> Iterator[dict]:
    """A stage that breaks the static image shape."""
    for sample in samples:
        sample["image"] = sample["image"][:, :4, :4]
        yield sample
