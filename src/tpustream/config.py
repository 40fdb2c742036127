"""Typed configuration schemas, registered in Hydra's ConfigStore.

The YAML files in conf/ fill these dataclasses; Hydra checks every key and
type against them when it composes the config, so a typo such as
``optim.lrr=0.1`` or ``epochs=ten`` fails before any process is spawned.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from tpustream.errors import ConfigError


class LastBatch(str, Enum):
    """What to do with training samples that cannot fill a whole global batch."""

    pad = "pad"  # wrap around to the epoch's first samples; they weigh zero in the loss
    drop = "drop"  # leave them out of this epoch (a different tail each epoch)


# What to do with a corrupt or incomplete sample or shard. skip: log it
# (bounded), count it and fill its place, so the step count never changes;
# raise: stop the run naming the shard and sample. The functional form lets a
# member be called "raise", which is what users type (data.on_error=raise).
OnError = Enum("OnError", {"skip": "skip", "raise": "raise"}, type=str)


class TrainCrop(str, Enum):
    """How a training image becomes the model's input."""

    # Zero-pad by data.crop_padding and crop back at a random offset (the
    # CIFAR recipe): for small images all of one size.
    pad_crop = "pad_crop"
    # torchvision's RandomResizedCrop to data.image_size (the ImageNet
    # recipe), for images of any size; evaluation then resizes the shorter
    # side to image_size / eval_crop_ratio and takes the centre square.
    random_resized = "random_resized"


class IndexMode(str, Enum):
    """What to do when no sample count is recorded for a shard."""

    auto = "auto"  # count the shards at start (once per job) and save an index for the next run
    never = "never"  # a missing count is an error: run `tpustream-index` first


class Device(str, Enum):
    CPU = "CPU"
    TPU = "TPU"


class Collectives(str, Enum):
    xla = "xla"  # torch_xla collectives across the XLA devices of an xmp.spawn job (TPU, one CPU device)
    gloo = "gloo"  # a simulated pod: one process per replica, each its own XLA CPU device, over gloo


class Precision(str, Enum):
    fp32 = "fp32"
    # Convolutions and matmuls in bfloat16 under torch.autocast on the XLA
    # device; weights, optimizer state, loss and metrics stay float32.
    # (XLA_USE_BF16, the old mechanism, is deprecated upstream.)
    bf16 = "bf16"


class Strategy(str, Enum):
    # Every replica holds the whole model; gradients averaged by xm.optimizer_step.
    ddp = "ddp"
    # torch_xla's fully sharded data parallel: parameters, gradients and
    # optimizer state sharded over the replicas, for models that do not fit
    # one core. XLA collectives only (not the gloo-simulated pod).
    fsdp = "fsdp"
    # One process per host drives all of its devices as one GSPMD program:
    # data parallel over the device mesh, the model replicated.
    spmd = "spmd"
    # GSPMD with FSDPv2: parameters, gradients and optimizer state sharded
    # along the mesh; the answer for models that do not fit one core.
    spmd_fsdp = "spmd_fsdp"


# The strategies that run one GSPMD program per host instead of a process per device.
SPMD_STRATEGIES = (Strategy.spmd, Strategy.spmd_fsdp)


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"


class Schedule(str, Enum):
    cosine = "cosine"  # linear warmup, then cosine decay to min_lr_ratio * lr
    constant = "constant"  # linear warmup, then constant
    # linear warmup, then lr x decay_factor ** (epochs done // decay_every_epochs),
    # not below min_lr_ratio * lr (pytorch/xla's WarmupAndExponentialDecayScheduler)
    step = "step"


@dataclass
class DataConfig:
    """Where the shards are and how samples become batches."""

    name: str = MISSING
    # Folder or gs:// prefix holding train/ and test/ (or val/) as written by tpustream-make-shards.
    root: str = MISSING
    # A split's shards (any WebDataset shards, .tar or .tar.gz): a folder or
    # gs:// prefix, a brace pattern, a list of URLs or patterns, or an index
    # file (manifest.json, a wids shard index, tpustream-index.json). URLs may
    # be local, gs://, http(s):// or pipe:. A string or a list of strings.
    train_shards: Any = MISSING
    val_shards: Any = MISSING
    # The sample field holding the image; null = the first of jpg jpeg png ppm
    # pgm pbm webp bmp tif tiff gif raw present; "a;b" = a, else b.
    image_key: str | None = None
    # The sample field holding the integer label: cls, cls2, index, ..., or
    # json:<field> for a field of the sample's json member (json:a.b nests).
    label_key: str = "cls"
    # Classes when the shards have no tpustream manifest naming them (labels 0..n-1).
    num_classes: int | None = None
    # Image side in pixels (square); null = the manifest's, else the first sample's.
    image_size: int | None = None
    # Channels every image becomes (1 or 3); null = the manifest's, else 3.
    channels: int | None = None
    # Sample counts not recorded beside the shards: auto = count at start and
    # save tpustream-index.json (beside the shards, else in output_dir); never = error.
    index: IndexMode = IndexMode.auto
    # Extra webdataset stages run on decoded samples, in order: import paths
    # "package.module:function" of callables taking and returning an iterator
    # of {"image": uint8 CHW array, "label": int, ...} dicts (README: "Your own stages").
    stages: list[str] = field(default_factory=list)
    # Per-channel statistics of the training images, on the 0..1 scale.
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])
    # DataLoader worker processes per replica (0 = read in the training process).
    num_workers: int = 2
    # Batches each worker prepares ahead.
    prefetch_factor: int = 4
    # Encoded samples held for shuffling (the pipeline's memory bound); 0 = shard order only.
    shuffle_buffer: int = 2000
    last_batch: LastBatch = LastBatch.pad
    on_error: OnError = OnError.skip
    # Stop the run when more than this fraction of a split's samples were bad
    # or missing in an epoch (on_error=skip): padding a broken dataset is not training.
    max_bad_fraction: float = 0.01
    # Training crop: pad_crop (images of one size) or random_resized (any size, ImageNet's).
    train_crop: TrainCrop = TrainCrop.pad_crop
    # pad_crop: random crop after zero-padding by this many pixels (0 = no crop).
    crop_padding: int = 4
    # random_resized: evaluation resizes the shorter side to image_size / this
    # (0.875: 256 for 224) and takes the centre image_size square.
    eval_crop_ratio: float = 0.875
    hflip: bool = True
    # Read and decode the whole split once per replica and serve batches from
    # memory (shared with the DataLoader workers) instead of streaming shards
    # every epoch: same batches, no storage reads or decoding after the first.
    in_memory: bool = False


@dataclass
class ModelConfig:
    """A registered model family and its keyword options."""

    name: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.sgd
    # Peak learning rate: for the global batch (batch_size x replicas), or for
    # reference_batch_size when that is set.
    lr: float = 0.1
    # Linear scaling rule (Goyal et al. 2017): the peak becomes
    # lr x global batch / reference_batch_size, reached after the warmup. null = no scaling.
    reference_batch_size: int | None = None
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    schedule: Schedule = Schedule.cosine
    warmup_epochs: float = 1.0
    min_lr_ratio: float = 0.0
    # schedule=step: multiply the learning rate by decay_factor every
    # decay_every_epochs, counted from the first step (warmup included).
    decay_every_epochs: float = 30.0
    decay_factor: float = 0.1


@dataclass
class AcceleratorConfig:
    """Which XLA device type to run on and how many replicas per host."""

    device: Device = Device.CPU
    # Replicas on this host: null = one per XLA device, 1 = a single process.
    # XLA:CPU has no working cross-process collectives (pytorch/xla#9089), so
    # CPU allows 1, N with collectives=gloo (the simulated pod), or N virtual
    # devices in one process with strategy=spmd / spmd_fsdp.
    num_devices: int | None = None
    collectives: Collectives = Collectives.xla
    # Run the single replica inside this process instead of a spawned child (debuggers).
    in_process: bool = False


@dataclass
class CheckpointConfig:
    """When last.pt is written besides every epoch end, and where it goes if output_dir fails."""

    # Also write last.pt every this many training steps (0 = epoch ends only).
    every_n_steps: int = 0
    # Replicas agree on a stop request (SIGTERM) every this many steps and
    # evaluation batches: a small host-side collective each time on a pod.
    stop_check_every: int = 10
    # Local folder for a checkpoint that could not be written to output_dir
    # (e.g. GCS unreachable after retries); null = <log_dir>/unsaved.
    fallback_dir: str | None = None


@dataclass
class DebugConfig:
    """Checks that cost time; for tests and for chasing a misbehaving pod."""

    # Local folder: each replica writes the ids of the real training samples
    # it used, per epoch (shard index << 32 | sample index), to audit exactness.
    sample_log_dir: str | None = None
    # Every this many steps, check that all replicas hold bit-identical
    # parameters and stop if not (0 = never; copies the model to the host).
    check_sync_every: int = 0
    # Act as if SIGTERM arrived when the run reaches this global step (0 = never):
    # rehearses a preemption at a known point.
    stop_at_step: int = 0
    # Print a compact torch_xla metrics summary each epoch (compilations,
    # compile time, transfers, CPU fallbacks) and warn when a step recompiles.
    metrics: bool = False
    # Start the torch_xla profiler server on this port + local ordinal (0 = off).
    profiler_port: int = 0


@dataclass
class TrainConfig:
    """One training run."""

    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    accelerator: AcceleratorConfig = MISSING
    # Per replica and optimizer step; the global batch is batch_size x replicas.
    batch_size: int = 64
    # Split each replica's batch into this many micro-batches whose gradients
    # are summed before one optimizer step (less activation memory, same
    # update up to float rounding, except that BatchNorm normalises per micro-batch).
    micro_batches: int = 1
    precision: Precision = Precision.fp32
    strategy: Strategy = Strategy.ddp
    # strategy=fsdp: every submodule holding at least this many parameters not
    # yet wrapped becomes its own FSDP unit, gathered whole only while it runs
    # (ZeRO-3), so a core never holds all the weights at once; 0 = one unit.
    fsdp_wrap_min_params: int = 1_000_000
    epochs: int = 10
    seed: int = 0
    # Log a training line every this many steps (a host sync only on those steps).
    log_steps: int = 20
    # The run folder, a local path or gs://bucket/prefix: checkpoints/best.pt and
    # checkpoints/last.pt, config.yaml, metrics.jsonl.
    output_dir: str = MISSING
    # Local folder for per-replica log files (Hydra's run folder by default).
    log_dir: str | None = None
    # null: start fresh (refused if output_dir holds a run); "overwrite": delete
    # the run in output_dir and start fresh; "auto": continue from output_dir's
    # checkpoints/last.pt if it is there (or best.pt if last.pt is damaged),
    # refusing if that run's config differs (the error names the keys); "force":
    # the same, accepting the difference; otherwise a checkpoint path or gs://
    # URL to start from (e.g. to fine-tune), until output_dir has a last.pt of its own.
    resume: str | None = "auto"
    # Evaluate every this many epochs and after the last one (0 = never: no
    # best.pt, last.pt only).
    eval_every: int = 1
    # Stop after this many evaluations without a better validation accuracy (0 = never).
    early_stop_patience: int = 0
    # Stop with an error when an epoch's loss is NaN or infinite (checkpoints keep the last finite epoch).
    stop_on_nonfinite_loss: bool = True
    # Persistent XLA compilation cache, a local folder (one subfolder per
    # replica process), so a rerun of the same config skips compiling.
    # auto: ~/.cache/tpustream/xla on TPU, off on CPU (torch_xla 2.9's CPU
    # client writes entries it cannot load); null: off.
    xla_cache_dir: str | None = "auto"
    # TensorBoard scalars under <output_dir>/tensorboard (gs://: written
    # locally, uploaded each epoch).
    tensorboard: bool = True
    # Only evaluate the checkpoint that resume names (or finds) and report.
    eval_only: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    """Register the schemas so conf/*.yaml can extend them by name."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="optim", name="optim_schema", node=OptimConfig)
    cs.store(group="accelerator", name="accelerator_schema", node=AcceleratorConfig)


# -- settings read from the environment (the few that are not config keys) --


def positive_seconds(name: str, default: float) -> float:
    """Environment variable `name` as a finite, positive number of seconds; ConfigError naming it if not."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"{name}={value!r}: expected a positive number of seconds (default {default:g})")
    return seconds
