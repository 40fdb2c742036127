"""What the data config says about a split beyond where its shards are."""

from __future__ import annotations

from dataclasses import dataclass

from tpustream.config import DataConfig, IndexMode, TrainCrop


@dataclass(frozen=True)
class SplitOptions:
    """What the data config says about a split beyond where its shards are."""

    image_key: str | None = None
    num_classes: int | None = None
    image_size: int | None = None  # square side; None = the manifest's, else the first sample's
    channels: int | None = None  # None = the manifest's, else 3
    # Images are cropped to image_size (data.train_crop=random_resized): any
    # stored size will do, and image_size is the crops' size, not the stored one.
    crop: bool = False
    # data.label_key. Set (training), the first samples are read as training
    # reads them, so a wrong image or label key fails before spawning instead
    # of after an epoch of bad samples; None (tools) reads no sample for it.
    label_key: str | None = None
    allow_counting: bool = True  # data.index=auto
    # This process may count shards without a count (on a pod, host 0 only:
    # the others get CountsNotReady and wait for its index, in launch/).
    counting_host: bool = True
    output_dir: str | None = None  # where an index goes when the shards' folder is read-only
    progress: bool = True

    @classmethod
    def from_config(cls, data: DataConfig, output_dir: str | None = None) -> SplitOptions:
        """A run's data.* section as split resolution reads it (training: the first samples are checked)."""
        return cls(
            image_key=data.image_key,
            num_classes=data.num_classes,
            image_size=data.image_size,
            channels=data.channels,
            crop=TrainCrop(data.train_crop) == TrainCrop.random_resized,
            label_key=data.label_key,
            allow_counting=IndexMode(data.index) == IndexMode.auto,
            output_dir=output_dir,
        )
