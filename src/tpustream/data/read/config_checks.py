"""The data.* checks that need the reading code: sample keys, the evaluation crop, the user's stages.

DataConfig checks its fields on their own; what only the code that reads the
samples can judge is checked here, and launch.checks calls it before
spawning, so a bad key or stage is one line instead of an error in every
replica's first batch. The config stays a leaf that imports no data code.
"""

from __future__ import annotations

from tpustream.config import DataConfig
from tpustream.data.format.decode import check_image_key, check_label_key
from tpustream.data.read.crops import check_eval_crop_ratio
from tpustream.data.read.user_stages import load_user_stage


def check_data_config(data: DataConfig) -> None:
    """ConfigError naming the data.* key the decoder, the crops or the stage loader would refuse."""
    check_image_key(data.image_key)
    check_label_key(data.label_key)
    check_eval_crop_ratio(data.eval_crop_ratio)
    for path in data.stages:
        load_user_stage(path)  # imported now: a missing module or callable fails before spawning
