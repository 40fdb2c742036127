"""Typed configuration schemas: one dataclass per section, each checking its own fields (``check``).

The YAML files in conf/ fill these dataclasses; Hydra checks every key and
type against them when it composes the config, so a typo such as
``optim.lrr=0.1`` or ``epochs=ten`` fails before any process is spawned.
The recipe's sections (model, optim, ema) are in ``recipe``. Checks across
sections, the data and the machine are launch.checks'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from tpustream.config.choices import (
    Collectives,
    Decode,
    Device,
    IndexMode,
    LastBatch,
    OnError,
    Precision,
    RuntimeKind,
    Strategy,
    TrainCrop,
)
from tpustream.config.recipe import AugmentConfig, EmaConfig, ModelConfig, OptimConfig
from tpustream.errors import ConfigError


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
    # of {"image": uint8 CHW array, "label": int, ...} dicts (docs/data.md: "Your own stages").
    stages: list[str] = field(default_factory=list)
    # Per-channel statistics of the training images, on the 0..1 scale.
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.25, 0.25, 0.25])
    # DataLoader worker processes per replica (0 = read in the training process), or
    # auto: chosen at start from the pipeline's measured rate (launch.workers; docs/watching.md).
    num_workers: Any = 2
    # Batches each worker prepares ahead. With workers, a loader keeps whole batches in
    # shared memory (/dev/shm) for them to write into: prefetch_factor + 3 (training
    # under canonical streams), 2 a worker + 3 (validation; data.read.assemble.ring_slots).
    prefetch_factor: int = 4
    # Encoded samples each reader (a worker, or a replica without workers) holds
    # for shuffling (the pipeline's memory bound); 0 = shard order only.
    shuffle_buffer: int = 2000
    # Canonical streams the training order is cut into, fixed when a run starts
    # and kept by its checkpoints (docs/progress.md: "Resume on any shape"): a stopped run
    # continues on any number of replicas dividing it, with any workers up to
    # its share per replica. auto = a few per reader, more where that evens out
    # the workers' shares (docs/input.md); 0 = a per-reader order that resumes
    # mid-epoch only on the same shape.
    streams: Any = "auto"
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
    # random_resized: where JPEGs are decoded. host = in the DataLoader workers;
    # device = on the replica's GPU (nvJPEG): the workers only read the bytes and
    # draw the crops, for GPU hosts with few vCPUs per GPU (docs/input.md). The
    # native runtime only (accelerator=cuda, cpu_eager); TPUs decode on the host.
    decode: Decode = Decode.host
    # Read and decode the whole split once per replica and serve batches from
    # memory (shared with the DataLoader workers) instead of streaming shards
    # every epoch: same batches, no storage reads or decoding after the first.
    in_memory: bool = False
    # Train on one batch of the data's shapes and label range, made once per
    # replica and kept on the device: the run's own step (model, optimizer,
    # precision, strategy, device augmentation, EMA) with no input pipeline,
    # so its samples/s is the accelerator's rate, the yardstick for a real
    # run's. Shapes from the shards' manifest when there are shards, else from
    # num_classes, image_size and channels. No evaluation, no checkpoints;
    # metrics.jsonl is marked "synthetic" (docs/watching.md).
    synthetic: bool = False
    # data.synthetic: steps an epoch; null = the training split's steps, or 100 without shards.
    synthetic_steps: int | None = None

    def check(self) -> None:
        """Each data.* field on its own.

        What the reading code judges (keys, the evaluation crop, data.stages) is
        data.read.checks.check_data_config's; what needs the manifest,
        launch.checks.check_data's. Both run before spawning.
        """
        for name in ("train_shards", "val_shards"):
            value = getattr(self, name)
            if value is None and self.synthetic:
                continue  # the batch's shapes are data.num_classes, image_size and channels
            if not (
                isinstance(value, str)
                or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))
            ):
                raise ConfigError(
                    f"data.{name} must be a string or a non-empty list of strings, got {value!r}"
                )
        if self.channels not in (None, 1, 3):
            raise ConfigError(f"data.channels must be 1 or 3 (or null: the manifest's), got {self.channels}")
        for name in ("num_classes", "image_size", "synthetic_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"data.{name} must be at least 1 (or null), got {value}")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor must be at least 1, got {self.prefetch_factor}")
        workers = self.num_workers
        if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise ConfigError(f"data.num_workers must be a whole number >= 0 or auto, got {workers!r}")
        streams = self.streams
        if streams != "auto" and (isinstance(streams, bool) or not isinstance(streams, int) or streams < 0):
            raise ConfigError(f"data.streams must be a whole number >= 0 or auto, got {streams!r}")
        if self.crop_padding < 0 or self.shuffle_buffer < 0:
            raise ConfigError("data.crop_padding and data.shuffle_buffer must be >= 0")
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise ConfigError("data.mean and data.std need one value per channel, std > 0")
        if self.train_crop == TrainCrop.random_resized and self.in_memory:
            raise ConfigError(
                "data.in_memory holds decoded images of one size; data.train_crop=random_resized "
                "crops every epoch anew from the encoded images: use one or the other"
            )
        if self.decode == Decode.device:
            if self.train_crop != TrainCrop.random_resized:
                raise ConfigError(
                    "data.decode=device decodes JPEGs into random-resized crops on the device: it needs "
                    "data.train_crop=random_resized (images of one size are decoded on the host)"
                )
            if self.stages:
                raise ConfigError(
                    "data.stages run on decoded images in the workers; with data.decode=device the "
                    "workers never see pixels: use data.decode=host with data.stages"
                )


@dataclass
class AcceleratorConfig:
    """Which device type to run on, through which runtime, and how many replicas per host."""

    device: Device = Device.CPU
    # Replicas on this host: null = one per device (XLA device, GPU), 1 = a single process.
    # XLA:CPU has no working cross-process collectives (pytorch/xla#9089), so
    # CPU allows 1, N with collectives=gloo (the simulated pod), or N virtual
    # devices in one process with strategy=spmd / spmd_fsdp.
    num_devices: int | None = None
    collectives: Collectives = Collectives.xla
    # xla: torch_xla runs the replicas' tensors; native: PyTorch alone (device=CUDA,
    # or CPU processes over gloo), without importing torch_xla.
    runtime: RuntimeKind = RuntimeKind.xla
    # Run the single replica inside this process instead of a spawned child (debuggers).
    in_process: bool = False
    # The native runtime's (accelerator=cuda, cpu_eager). deterministic: cuDNN's
    # deterministic kernels and no autotuning, so runs and resumes repeat bit
    # for bit (measured on an H200: 4.1x slower for wrn_seed); false:
    # cudnn.benchmark, the fastest kernel per shape, last bits may differ.
    # channels_last: the model's weights and each batch in NHWC (tensor cores'
    # layout for convolutions). compile: torch.compile the model in place (its
    # state_dict, so checkpoints, unchanged). docs/gpus.md.
    deterministic: bool = False
    channels_last: bool = False
    compile: bool = False

    def check(self) -> None:
        """How many devices, on its own (what the strategy allows is launch.checks.check_config's)."""
        if self.num_devices is not None and self.num_devices < 1:
            raise ConfigError(
                f"accelerator.num_devices must be at least 1 (or null: every device), got {self.num_devices}"
            )
        native = [name for name in ("channels_last", "compile") if getattr(self, name)]
        if native and self.runtime != RuntimeKind.native:
            raise ConfigError(
                f"accelerator.{native[0]} is the native runtime's (accelerator=cuda or cpu_eager); "
                "XLA lays out and compiles the model itself"
            )


@dataclass
class CheckpointConfig:
    """When last.pt is written besides every epoch end, how, and where it goes if output_dir fails."""

    # Also write last.pt every this many training steps (0 = epoch ends only).
    every_n_steps: int = 0
    # Replicas agree on a stop request (SIGTERM) every this many steps and
    # evaluation batches: a small host-side collective each time on a pod.
    stop_check_every: int = 10
    # Local folder for a checkpoint that could not be written to output_dir
    # (e.g. GCS unreachable after retries); null = <log_dir>/unsaved.
    fallback_dir: str | None = None
    # Training waits only for the state's copy into host memory; the master
    # serialises, writes and verifies it in the background (one save in flight;
    # a stop and the run's end wait for it). docs/progress.md.
    asynchronous: bool = True
    # The largest host copy (bytes) held while training goes on; a larger state
    # is saved synchronously, with a warning. null = the memory still available
    # on the host (MemAvailable), checked until a save has kept host buffers.
    asynchronous_max_bytes: int | None = None
    # Local folder (a local SSD) where last.pt is written first, then uploaded
    # to output_dir; a restart on the same host continues from the newer copy.
    local_dir: str | None = None

    def check(self) -> None:
        if self.every_n_steps < 0:
            raise ConfigError(
                f"checkpoint.every_n_steps must be >= 0 (0 = epoch ends only), got {self.every_n_steps}"
            )
        if self.asynchronous_max_bytes is not None and self.asynchronous_max_bytes < 0:
            raise ConfigError(
                f"checkpoint.asynchronous_max_bytes must be >= 0 (null = the memory available), "
                f"got {self.asynchronous_max_bytes}"
            )
        if self.local_dir is not None and "://" in self.local_dir:
            raise ConfigError(f"checkpoint.local_dir must be a local folder, got {self.local_dir}")
        if self.stop_check_every < 1:
            raise ConfigError(f"checkpoint.stop_check_every must be at least 1, got {self.stop_check_every}")


@dataclass
class WatchdogConfig:
    """Each replica's progress watchdog (tpustream.watchdog; docs/progress.md: "Hangs")."""

    # Seconds without progress (a training or evaluation step finished, a batch
    # received, checkpoint bytes written) before a replica writes every thread's
    # stacks to <output_dir>/watchdog/ and the run exits 76, which launchers
    # retry. auto: 20 x the median training step, at least 300; 0 = off.
    seconds: Any = "auto"
    # The allowance instead while the process compiles: until its first steps
    # have finished, and those after its first evaluation, epoch end and save.
    first_step_seconds: float = 3600.0
    # After a stop request (SIGTERM): a replica that makes no progress for this
    # long (its step cannot finish) writes its stacks and exits 75 without saving;
    # last.pt keeps the last save. Keep it under the host's notice (about 30 s
    # on a preempted TPU VM); 0 = wait for the step however long it takes.
    stop_grace_seconds: float = 20.0

    def check(self) -> None:
        seconds = self.seconds
        if seconds != "auto" and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
        ):
            raise ConfigError(
                f"watchdog.seconds must be a number of seconds >= 0 (0 = off) or auto, got {seconds!r}"
            )
        if self.first_step_seconds <= 0:
            raise ConfigError(f"watchdog.first_step_seconds must be > 0, got {self.first_step_seconds}")
        if self.stop_grace_seconds < 0:
            raise ConfigError(
                f"watchdog.stop_grace_seconds must be >= 0 (0 = off), got {self.stop_grace_seconds}"
            )


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
    # Capture a trace from global step START to END ([START, END], START >= 1: the
    # END - START steps after the first START) into <output_dir>/tensorboard/: XLA's for
    # TensorBoard's profile plugin / XProf, or on accelerator.runtime=native torch.profiler's
    # for Perfetto; [] = off. profile_eval_epoch: the same for the evaluation after that
    # epoch (-1 = off). Master only unless profile_all_replicas.
    profile_steps: list[int] = field(default_factory=list)
    profile_eval_epoch: int = -1
    profile_all_replicas: bool = False

    def check(self) -> None:
        steps = list(self.profile_steps)
        if steps and not (len(steps) == 2 and 1 <= steps[0] < steps[1]):
            raise ConfigError(
                f"debug.profile_steps is [START, END] with 1 <= START < END (global steps), got {steps}"
            )
        if not 0 <= self.profiler_port < 65536:
            raise ConfigError(f"debug.profiler_port must be a TCP port (0 = off), got {self.profiler_port}")
        for name in ("check_sync_every", "stop_at_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"debug.{name} must be >= 0 (0 = off), got {getattr(self, name)}")


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
    # strategy=spmd_fsdp, and fsdp (FSDP2) on the native runtime: every submodule
    # holding at least this many parameters not yet wrapped becomes its own FSDP
    # unit, gathered whole only while it runs (ZeRO-3), so a device never holds
    # all the weights at once; 0 = one unit.
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
    ema: EmaConfig = field(default_factory=EmaConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def check(self) -> None:
        """Every section's own fields, then the top-level keys.

        The model section has no check of its own: its name, options and
        weights are the model code's to judge. That, and what the data and
        augmentation code judge, and the rules across sections, are what
        launch.checks.check_config adds.
        """
        for section in (self.data, self.optim, self.accelerator):
            section.check()
        for section in (self.checkpoint, self.ema, self.augment, self.debug, self.watchdog):
            section.check()
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0 (numpy seeds the data order with it), got {self.seed}")
        for name in ("batch_size", "epochs", "log_steps", "micro_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batches:
            raise ConfigError(
                f"micro_batches={self.micro_batches} must divide batch_size={self.batch_size} "
                "(every micro-batch has the same shape, so the step compiles once)"
            )
        for name in ("eval_every", "early_stop_patience", "fsdp_wrap_min_params"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.augment.mixing() and self.batch_size % 2:
            raise ConfigError(
                f"augment.* mixing pairs sample i with sample B-1-i of each device's batch: "
                f"batch_size must be even, got {self.batch_size}"
            )
        if self.eval_every == 0 and self.early_stop_patience:
            raise ConfigError("early_stop_patience needs validation; eval_every=0 turns it off")
