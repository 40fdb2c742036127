"""data.synthetic before spawning and in each replica: the batch's shapes, the rules, the sources.

Before spawning: the shapes come from the training split's manifest when its
shards are there (no sample is read for it: the first-samples check is a
real run's), else from data.num_classes, image_size and channels; the run
neither continues nor overwrites a run folder's checkpoints, evaluates
nothing and uses no loader workers. In a replica: one batch, made once, on
the device for every step (data.read.synthetic_batch).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tpustream import storage
from tpustream.checkpoint import FORCE_RESUME, OVERWRITE_RESUME
from tpustream.config import TrainConfig
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import plan_layout
from tpustream.data.read.synthetic_batch import (
    DEFAULT_STEPS,
    SyntheticSource,
    make_synthetic_batch,
    stand_in_manifest,
)
from tpustream.data.resolve.options import SplitOptions
from tpustream.data.resolve.shard_spec import describe_spec, expand_spec
from tpustream.errors import ConfigError
from tpustream.launch.hosts import load_split_on_this_host

log = logging.getLogger(__name__)

# The data.* keys a synthetic batch takes its shapes from when there are no shards.
SHAPE_KEYS = ("num_classes", "image_size", "channels")


def check_synthetic_config(cfg: TrainConfig) -> None:
    """What a synthetic run cannot do, refused in one line (nothing is learned from data)."""
    if cfg.eval_only:
        raise ConfigError("data.synthetic trains on no data: eval_only has nothing to evaluate it on")
    if cfg.early_stop_patience:
        raise ConfigError("data.synthetic evaluates nothing: early_stop_patience would never act; drop it")
    if cfg.resume not in (None, "", "auto", FORCE_RESUME, OVERWRITE_RESUME):
        raise ConfigError(
            f"data.synthetic measures the step from the model's initial weights: resume={cfg.resume} "
            "has nothing to continue (model.pretrained starts from given weights)"
        )


def missing_shards(spec: Any) -> str | None:
    """Why data.train_shards names no shard that is there (None: it does)."""
    if spec is None:
        return "data.train_shards=null"
    try:
        urls = expand_spec(spec).urls
    except ConfigError as exc:
        return str(exc)
    if not urls or not storage.exists(urls[0]):
        return f"{describe_spec(spec)}: no shard there"
    return None


def synthetic_splits(
    cfg: TrainConfig, plain: dict[str, Any], options: SplitOptions
) -> tuple[ShardManifest, ShardManifest]:
    """(train, validation) a synthetic run plans from, and its config made to say what it does.

    Validation is the training split's shapes: nothing is evaluated.
    eval_every becomes 0 and data.num_workers=auto 0, in both forms of the
    config, as if typed (config.yaml then says what ran).
    """
    check_synthetic_config(cfg)
    why = missing_shards(cfg.data.train_shards)
    if why is None:
        # Counts and shapes as a real run finds them; label_key=None reads no sample to check.
        options = dataclasses.replace(options, label_key=None)
        train = load_split_on_this_host(cfg.data.train_shards, "train", options)
        planned = f"an epoch is as many steps as the training split's {train.num_samples} samples make"
    else:
        missing = [f"data.{key}" for key in SHAPE_KEYS if getattr(cfg.data, key) is None]
        if missing:
            raise ConfigError(
                f"data.synthetic without shards ({why}) takes the batch's shapes from the config: "
                f"set {', '.join(missing)}"
            )
        train = stand_in_manifest(cfg.data.num_classes, cfg.data.image_size, cfg.data.channels)
        planned = f"{DEFAULT_STEPS} steps an epoch (no shards: {why})"
    if cfg.data.synthetic_steps:
        planned = f"{cfg.data.synthetic_steps} steps an epoch (data.synthetic_steps)"
    cfg.eval_every = plain["eval_every"] = 0
    if cfg.data.num_workers == "auto":
        cfg.data.num_workers = plain["data"]["num_workers"] = 0
    if train.image_size is None:  # images of many sizes: check_data refuses them next
        return train, dataclasses.replace(train, split="validation")
    log.info(
        "data.synthetic: one batch a replica of %dx%dx%d uint8 images, labels 0..%d, on the device for "
        "every step; %s; no storage reads, no evaluation, no checkpoints",
        train.channels,
        *train.image_size,
        train.num_classes - 1,
        planned,
    )
    return train, dataclasses.replace(train, split="validation")


def synthetic_steps(cfg: TrainConfig, train: ShardManifest, replica_batch: int, world_size: int) -> int:
    """Steps an epoch: data.synthetic_steps, else the training split's (a real run's), else DEFAULT_STEPS."""
    if cfg.data.synthetic_steps:
        return cfg.data.synthetic_steps
    if not train.shards:
        return DEFAULT_STEPS
    return plan_layout(train.num_samples, replica_batch, world_size, cfg.data.last_batch, "train").steps


def make_synthetic_sources(
    cfg: TrainConfig, train: ShardManifest, runtime, replica_batch: int
) -> tuple[SyntheticSource, SyntheticSource]:
    """This replica's (train, validation) sources: one batch of the run's shapes, and no validation."""
    draws = None
    if cfg.augment.active():
        from tpustream.augment.draws import BatchDraws

        # The device augmentation's draws travel with the batch, as with real data.
        draws = BatchDraws(cfg.augment, train.image_size, train.channels, group=cfg.batch_size, seed=cfg.seed)
    shape = (replica_batch, train.channels, *train.image_size)
    batch = make_synthetic_batch(shape, train.num_classes, cfg.seed, runtime.rank, draws)
    steps = synthetic_steps(cfg, train, replica_batch, runtime.world_size)
    if runtime.is_master:
        log.info(
            "train: %d steps/epoch of %d x %d replica(s) on one synthetic batch each; no validation",
            steps,
            replica_batch,
            runtime.world_size,
        )
    return SyntheticSource(batch, steps), SyntheticSource({}, 0)
