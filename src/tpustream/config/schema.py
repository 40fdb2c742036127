"""Typed configuration schemas: one dataclass per section, each checking its own fields (``check``).

The YAML files in conf/ fill these dataclasses; Hydra checks every key and
type against them when it composes the config, so a typo such as
``optim.lrr=0.1`` or ``epochs=ten`` fails before any process is spawned.
Each field is a ``setting``: its default, what it does (docs/configuration.md's
line for it) and its facts (config.facts). The recipe's sections (model,
optim, ema) are in ``recipe``. Checks across sections, the data and the
machine are launch.checks'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from tpustream.config.choices import (
    MESH_AXES,
    PLATFORMS,
    Accelerator,
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
from tpustream.config.facts import OnResume, setting
from tpustream.config.recipe import AugmentConfig, EmaConfig, ModelConfig, OptimConfig
from tpustream.errors import ConfigError


@dataclass
class DataConfig:
    """Where the shards are and how samples become batches."""

    root: str = setting(
        MISSING,
        "Folder or gs:// prefix holding train/ and test/ (or val/) as written by tpustream-make-shards.",
        path=True,
    )
    train_shards: Any = setting(
        MISSING,
        "A split's shards (any WebDataset shards, .tar or .tar.gz): a folder or gs:// prefix, a brace "
        "pattern, a list of URLs or patterns, or an index file (manifest.json, a wids shard index, "
        "tpustream-index.json). URLs may be local, gs://, http(s):// or pipe:. A string or a list of "
        "strings.",
        path=True,
    )
    val_shards: Any = setting(
        MISSING, "The validation split's shards, given as data.train_shards are.", path=True
    )
    image_key: str | None = setting(
        None,
        "The sample field holding the image; null = the first of jpg jpeg png ppm pgm pbm webp bmp tif "
        'tiff gif raw present; "a;b" = a, else b.',
    )
    label_key: str = setting(
        "cls",
        "The sample field holding the integer label: cls, cls2, index, ..., or json:<field> for a field "
        "of the sample's json member (json:a.b nests).",
    )
    num_classes: int | None = setting(
        None,
        "Classes when the shards have no tpustream manifest naming them (labels 0..n-1).",
    )
    image_size: int | None = setting(
        None,
        "Image side in pixels (square); null = the manifest's, else the first sample's.",
    )
    channels: int | None = setting(
        None,
        "Channels every image becomes (1 or 3); null = the manifest's, else 3.",
    )
    index: IndexMode = setting(
        IndexMode.auto,
        "Sample counts not recorded beside the shards: auto = count at start and save "
        "tpustream-index.json (beside the shards, else in output_dir); never = error.",
    )
    stages: list[str] = setting(
        factory=list,
        doc='Extra webdataset stages run on decoded samples, in order: import paths "package.module:function"'
        ' of callables taking and returning an iterator of {"image": uint8 CHW array, "label": int, ...} '
        'dicts (docs/data.md: "Your own stages").',
    )
    mean: list[float] = setting(
        factory=lambda: [0.5, 0.5, 0.5],
        doc="Per-channel statistics of the training images, on the 0..1 scale.",
    )
    std: list[float] = setting(
        factory=lambda: [0.25, 0.25, 0.25],
        doc="Per-channel standard deviations of the training images, on the 0..1 scale.",
    )
    num_workers: Any = setting(
        2,
        "DataLoader worker processes per replica (0 = read in the training process), or auto: chosen at "
        "start from the pipeline's measured rate (launch.auto_workers; docs/watching.md).",
        resume=OnResume.change,
    )
    prefetch_factor: int = setting(
        4,
        "Batches each worker prepares ahead. With workers, a loader keeps whole batches in shared memory "
        "(/dev/shm) for them to write into: prefetch_factor + 3 (training under canonical streams), 2 a "
        "worker + 3 (validation; data.read.assemble.ring_slots).",
        resume=OnResume.change,
    )
    shuffle_buffer: int = setting(
        2000,
        "Encoded samples each reader (a worker, or a replica without workers) holds for shuffling (the "
        "pipeline's memory bound); 0 = shard order only.",
    )
    # A continued run keeps its checkpoint's partition whatever this says now.
    streams: Any = setting(
        "auto",
        "Canonical streams the training order is cut into, fixed when a run starts and kept by its "
        'checkpoints (docs/progress.md: "Resume on any shape"): a stopped run continues on any number of '
        "replicas dividing it, with any workers up to its share per replica. auto = a few per reader, "
        "more where that evens out the workers' shares (docs/input.md); 0 = a per-reader order that "
        "resumes mid-epoch only on the same shape.",
        resume=OnResume.change,
    )
    last_batch: LastBatch = setting(
        LastBatch.pad,
        "Training samples that cannot fill a whole global batch: pad = wrap around to the epoch's first "
        "samples, which weigh zero in the loss; drop = leave them out of this epoch.",
    )
    on_error: OnError = setting(
        OnError.skip,
        "A corrupt or incomplete sample or shard: skip = log it (bounded), count it and fill its place, "
        "so the step count never changes; raise = stop the run naming the shard and sample.",
    )
    max_bad_fraction: float = setting(
        0.01,
        "Stop the run when more than this fraction of a split's samples were bad or missing in an epoch "
        "(on_error=skip): padding a broken dataset is not training.",
    )
    train_crop: TrainCrop = setting(
        TrainCrop.pad_crop,
        "Training crop: pad_crop (images of one size) or random_resized (any size, ImageNet's).",
    )
    crop_padding: int = setting(
        4,
        "pad_crop: random crop after zero-padding by this many pixels (0 = no crop).",
    )
    eval_crop_ratio: float = setting(
        0.875,
        "random_resized: evaluation resizes the shorter side to image_size / this (0.875: 256 for 224) "
        "and takes the centre image_size square.",
    )
    hflip: bool = setting(True, "Flip training images left to right with probability 1/2.")
    # A continued run may decode elsewhere: the same crops either way (pixels within a level, or
    # the host's DCT scaling); a GPU run continued on a TPU must switch to host.
    decode: Decode = setting(
        Decode.host,
        "random_resized: where JPEGs are decoded. host = in the DataLoader workers; device = on the "
        "replica's GPU (nvJPEG): the workers only read the bytes and draw the crops, for GPU hosts with "
        "few vCPUs per GPU (docs/input.md). The native runtime only (accelerator=cuda, cpu_eager); TPUs "
        "decode on the host.",
        resume=OnResume.change,
    )
    in_memory: bool = setting(
        False,
        "Read and decode the whole split once per replica and serve batches from memory (shared with the "
        "DataLoader workers) instead of streaming shards every epoch: same batches, no storage reads or "
        "decoding after the first.",
    )
    synthetic: bool = setting(
        False,
        "Train on one batch of the data's shapes and label range, made once per replica and kept on the "
        "device: the run's own step (model, optimizer, precision, strategy, device augmentation, EMA) "
        "with no input pipeline, so its samples/s is the accelerator's rate, the yardstick for a real "
        "run's. Shapes from the shards' manifest when there are shards, else from num_classes, image_size"
        ' and channels. No evaluation, no checkpoints; metrics.jsonl is marked "synthetic" '
        "(docs/watching.md).",
    )
    synthetic_steps: int | None = setting(
        None,
        "data.synthetic: steps an epoch; null = the training split's steps, or 100 without shards.",
    )

    def check(self) -> None:
        """Each data.* field on its own.

        What the reading code judges (keys, the evaluation crop, data.stages) is
        data.read.config_checks.check_data_config's; what needs the manifest,
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
    """What runs the job (its name decides device type, runtime and collectives), with how many replicas."""

    @property
    def device(self) -> Device:
        return PLATFORMS[Accelerator(self.name)].device

    @property
    def runtime(self) -> RuntimeKind:
        return PLATFORMS[Accelerator(self.name)].runtime

    @property
    def collectives(self) -> Collectives:
        return PLATFORMS[Accelerator(self.name)].collectives

    name: Accelerator = setting(
        Accelerator.cpu,
        "The accelerator option's name (accelerator=cpu, tpu, cpu_pod, cuda, cpu_eager): it decides the "
        "device type, the runtime (torch_xla, or PyTorch itself) and how replicas reduce "
        "(config.choices.PLATFORMS).",
    )
    num_devices: int | None = setting(
        None,
        "Replicas on this host: null = one per device (XLA device, GPU), 1 = a single process. XLA:CPU "
        "has no working cross-process collectives (pytorch/xla#9089), so CPU allows 1, N with "
        "accelerator=cpu_pod (the simulated pod, over gloo) or cpu_eager, or N virtual devices in one "
        "process with strategy=spmd / spmd_fsdp.",
    )
    in_process: bool = setting(
        False,
        "Run the single replica inside this process instead of a spawned child (debuggers).",
    )
    # The native runtime's three (docs/gpus.md).
    deterministic: bool = setting(
        False,
        "Native runtime: cuDNN's deterministic kernels and no autotuning, so runs and resumes repeat bit "
        "for bit (measured on an H200: 4.1x slower for wrn_seed); false = cudnn.benchmark, the fastest "
        "kernel per shape, last bits may differ.",
    )
    channels_last: bool = setting(
        False,
        "Native runtime: the model's weights and each batch in NHWC (tensor cores' layout for convolutions).",
    )
    compile: bool = setting(
        False,
        "Native runtime: torch.compile the model in place (its state_dict, so checkpoints, unchanged).",
    )

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
class MeshConfig:
    """strategy=spmd / spmd_fsdp: the named device mesh one GSPMD program runs on (docs/large-models.md).

    A slice's devices are data x fsdp x tensor; slices join over the
    data-centre network. The batch is split over slices, data and fsdp;
    parameters, gradients and optimizer state over fsdp (and, for the layers
    mesh.rules match, tensor), and whole over data and slices.
    """

    data: int | None = setting(
        None,
        "Devices that each hold what fsdp and tensor leave of the model and split the batch (data "
        "parallel). null = by the strategy: the rest of a slice's devices under spmd, 1 under spmd_fsdp; "
        "-1 = the rest.",
    )
    fsdp: int | None = setting(
        None,
        "Devices that split the batch and shard parameters, gradients and optimizer state along each "
        "parameter's largest dimension (FSDPv2, ZeRO-3). null = by the strategy: 1 under spmd, the rest "
        "of a slice's devices under spmd_fsdp; -1 = the rest.",
    )
    tensor: int = setting(
        1,
        "Devices that split the weights of the layers mesh.rules match, and those layers' matmuls "
        "(tensor parallelism); they work on the same samples. -1 = the rest of a slice's devices.",
    )
    slices: int = setting(
        1,
        "TPU slices joined over the data-centre network (multislice, torch_xla's HybridMesh): the batch "
        "is split across them and the model is whole in each (data parallel over DCN).",
    )
    rules: list[Any] | None = setting(
        None,
        "Tensor-parallel sharding rules, used when mesh.tensor > 1: an ordered list of [parameter-name "
        "pattern, partition spec], the first match wins; a pattern is a glob over the plain model's "
        "parameter names (* matches anything), a spec has one entry per dimension: an axis name (fsdp, "
        "tensor, data), a list of them, or null. Parameters no rule matches are split as FSDPv2 splits "
        "them. null = the built-in rules for timm's ViT family and torchvision's ViT "
        "(training.sharding_rules).",
    )

    def check(self) -> None:
        """Sizes on their own (against the devices: runtime.mesh.mesh_shape)."""
        for name in ("data", "fsdp", "tensor"):
            value = getattr(self, name)
            if value is not None and value != -1 and value < 1:
                raise ConfigError(
                    f"mesh.{name} must be >= 1, or -1 for the rest of a slice's devices, got {value}"
                )
        if self.slices < 1:
            raise ConfigError(f"mesh.slices must be at least 1, got {self.slices}")
        rest = [name for name in ("data", "fsdp", "tensor") if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ConfigError(
                "only one mesh axis can be -1 (the rest of the devices), got "
                + " and ".join(f"mesh.{name}=-1" for name in rest)
            )
        for index, rule in enumerate(self.rules or []):
            if not (isinstance(rule, list | tuple) and len(rule) == 2 and isinstance(rule[0], str)):
                raise ConfigError(
                    f"mesh.rules[{index}] must be [pattern, spec], e.g. ['blocks.*.mlp.fc1.weight', "
                    f"[tensor, fsdp]], got {rule!r}"
                )
            spec = rule[1]
            if not isinstance(spec, list | tuple):
                raise ConfigError(
                    f"mesh.rules[{index}]: the spec of {rule[0]!r} must be a list, one entry per "
                    f"dimension, got {spec!r}"
                )
            for entry in spec:
                names = list(entry) if isinstance(entry, list | tuple) else [entry]
                for name in names:
                    if name is not None and name not in MESH_AXES:
                        raise ConfigError(
                            f"mesh.rules[{index}]: {name!r} in the spec of {rule[0]!r} is not a mesh axis "
                            f"({', '.join(MESH_AXES)})"
                        )


@dataclass
class CheckpointConfig:
    """When last.pt is written besides every epoch end, how, and where it goes if output_dir fails."""

    every_n_steps: int = setting(
        0,
        "Also write last.pt every this many training steps (0 = epoch ends only).",
    )
    stop_check_every: int = setting(
        10,
        "Replicas agree on a stop request (SIGTERM) every this many steps and evaluation batches: a small"
        " host-side collective each time on a pod.",
    )
    fallback_dir: str | None = setting(
        None,
        "Local folder for a checkpoint that could not be written to output_dir (e.g. GCS unreachable "
        "after retries); null = <log_dir>/unsaved.",
    )
    asynchronous: bool = setting(
        True,
        "Training waits only for the state's copy into host memory; the master serialises, writes and "
        "verifies it in the background (one save in flight; a stop and the run's end wait for it). "
        "docs/progress.md.",
    )
    asynchronous_max_bytes: int | None = setting(
        None,
        "The largest host copy (bytes) held while training goes on; a larger state is saved "
        "synchronously, with a warning. null = the memory still available on the host (MemAvailable), "
        "checked until a save has kept host buffers.",
    )
    local_dir: str | None = setting(
        None,
        "Local folder (a local SSD) where last.pt is written first, then uploaded to output_dir; a "
        "restart on the same host continues from the newer copy.",
    )

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

    seconds: Any = setting(
        "auto",
        "Seconds without progress (a training or evaluation step finished, a batch received, checkpoint "
        "bytes written) before a replica writes every thread's stacks to <output_dir>/watchdog/ and the "
        "run exits 76, which launchers retry. auto: 20 x the median training step, at least 300; 0 = off.",
    )
    first_step_seconds: float = setting(
        3600.0,
        "The allowance instead while the process compiles: until its first steps have finished, and those"
        " after its first evaluation, epoch end and save.",
    )
    stop_grace_seconds: float = setting(
        20.0,
        "After a stop request (SIGTERM): a replica that makes no progress for this long (its step cannot "
        "finish) writes its stacks and exits 75 without saving; last.pt keeps the last save. Keep it "
        "under the host's notice (about 30 s on a preempted TPU VM); 0 = wait for the step however long "
        "it takes.",
    )

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

    sample_log_dir: str | None = setting(
        None,
        "Local folder: each replica writes the ids of the real training samples it used, per epoch (shard"
        " index << 32 | sample index), to audit exactness.",
    )
    check_sync_every: int = setting(
        0,
        "Every this many steps, check that all replicas hold bit-identical parameters and stop if not (0 "
        "= never; copies the model to the host).",
    )
    stop_at_step: int = setting(
        0,
        "Act as if SIGTERM arrived when the run reaches this global step (0 = never): rehearses a "
        "preemption at a known point.",
    )
    metrics: bool = setting(
        False,
        "Print a compact torch_xla metrics summary each epoch (compilations, compile time, transfers, CPU"
        " fallbacks) and warn when a step recompiles.",
    )
    profiler_port: int = setting(
        0,
        "Start the torch_xla profiler server on this port + local ordinal (0 = off).",
    )
    profile_steps: list[int] = setting(
        factory=list,
        doc="Capture a trace from global step START to END ([START, END], START >= 1: the END - START steps "
        "after the first START) into <output_dir>/tensorboard/: XLA's for TensorBoard's profile plugin / "
        "XProf, or on the native runtime (accelerator=cuda, cpu_eager) torch.profiler's for Perfetto; "
        "[] = off.",
    )
    profile_eval_epoch: int = setting(
        -1, "Trace the evaluation after this epoch as debug.profile_steps traces steps (-1 = off)."
    )
    profile_all_replicas: bool = setting(
        False, "Trace every replica, not only the master (debug.profile_steps, profile_eval_epoch)."
    )

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

    # The four sections conf/config.yaml's groups choose (data=, model=, optim=, accelerator=).
    # A synthetic run's step takes only the data's shapes, not how it is read.
    data: DataConfig = setting(MISSING, step=False)
    model: ModelConfig = setting(MISSING)
    optim: OptimConfig = setting(MISSING)
    # Where and on what a run goes on does not change what it trains.
    accelerator: AcceleratorConfig = setting(MISSING, resume=OnResume.change)
    batch_size: int = setting(
        64,
        "Per replica and optimizer step; the global batch is batch_size x replicas.",
        resume=OnResume.reshape,
    )
    micro_batches: int = setting(
        1,
        "Split each replica's batch into this many micro-batches whose gradients are summed before one "
        "optimizer step (less activation memory, same update up to float rounding, except that BatchNorm "
        "normalises per micro-batch).",
    )
    precision: Precision = setting(
        Precision.fp32,
        "bf16: convolutions and matmuls in bfloat16 under torch.autocast; weights, optimizer state, loss "
        "and metrics stay float32.",
    )
    strategy: Strategy = setting(
        Strategy.ddp,
        "How replicas share the work: ddp = data parallel, one process per device; spmd = one process "
        "over a mesh of XLA devices, replicated; spmd_fsdp = the same, parameters and optimizer state "
        "sharded (FSDPv2); fsdp = PyTorch's FSDP2, native runtime only (docs/large-models.md).",
        resume=OnResume.change,
    )
    mesh: MeshConfig = setting(factory=MeshConfig, resume=OnResume.change)
    fsdp_wrap_min_params: int = setting(
        1_000_000,
        "strategy=spmd_fsdp, and fsdp (FSDP2) on the native runtime: every submodule holding at least "
        "this many parameters not yet wrapped becomes its own FSDP unit, gathered whole only while it "
        "runs (ZeRO-3), so a device never holds all the weights at once; 0 = one unit.",
        resume=OnResume.change,
    )
    epochs: int = setting(
        10,
        "Epochs to train. A continued run may change it (optim.on_epochs_change decides what the schedule "
        "does).",
        resume=OnResume.ignore,
        step=False,
    )
    seed: int = setting(
        0, "Seeds the weights' initialisation, the data order and the augmentation draws.", step=False
    )
    log_steps: int = setting(
        20,
        "Log a training line every this many steps (a host sync only on those steps).",
        resume=OnResume.change,
        step=False,
    )
    output_dir: str = setting(
        MISSING,
        "The run folder, a local path or gs://bucket/prefix: checkpoints/best.pt and checkpoints/last.pt,"
        " config.yaml, metrics.jsonl.",
        resume=OnResume.ignore,
        step=False,
        path=True,
        per_run=True,
    )
    log_dir: str | None = setting(
        None,
        "Local folder for per-replica log files (Hydra's run folder by default).",
        resume=OnResume.ignore,
        step=False,
        path=True,
        per_run=True,
    )
    resume: str | None = setting(
        "auto",
        'null: start fresh (refused if output_dir holds a run); "overwrite": delete the run in output_dir'
        ' and start fresh; "auto": continue from output_dir\'s checkpoints/last.pt if it is there (or '
        "best.pt if last.pt is damaged), refusing if that run's config differs (the error names the "
        'keys); "force": the same, accepting the difference; otherwise a checkpoint path or gs:// URL to '
        "start from (e.g. to fine-tune), until output_dir has a last.pt of its own.",
        resume=OnResume.ignore,
        step=False,
    )
    eval_every: int = setting(
        1,
        "Evaluate every this many epochs and after the last one (0 = never: no best.pt, last.pt only).",
        resume=OnResume.ignore,
        step=False,
    )
    early_stop_patience: int = setting(
        0,
        "Stop after this many evaluations without a better validation accuracy (0 = never).",
        resume=OnResume.ignore,
        step=False,
    )
    stop_on_nonfinite_loss: bool = setting(
        True,
        "Stop with an error when an epoch's loss is NaN or infinite (checkpoints keep the last finite "
        "epoch).",
    )
    xla_cache_dir: str | None = setting(
        "auto",
        "Persistent XLA compilation cache, a local folder (one subfolder per replica process), so a rerun"
        " of the same config skips compiling. auto: ~/.cache/tpustream/xla on TPU, off on CPU (torch_xla "
        "2.9's CPU client writes entries it cannot load); null: off.",
        resume=OnResume.ignore,
        step=False,
    )
    tensorboard: bool = setting(
        True,
        "TensorBoard scalars under <output_dir>/tensorboard (gs://: written locally, uploaded each epoch).",
        resume=OnResume.ignore,
        step=False,
    )
    eval_only: bool = setting(
        False,
        "Only evaluate the checkpoint that resume names (or finds) and report.",
        resume=OnResume.ignore,
        step=False,
    )
    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig, resume=OnResume.change, step=False)
    ema: EmaConfig = setting(factory=EmaConfig)
    augment: AugmentConfig = setting(factory=AugmentConfig)
    debug: DebugConfig = setting(factory=DebugConfig, resume=OnResume.ignore, step=False)
    watchdog: WatchdogConfig = setting(factory=WatchdogConfig, resume=OnResume.ignore, step=False)

    def check(self) -> None:
        """Every section's own fields, then the top-level keys.

        The model section has no check of its own: its name, options and
        weights are the model code's to judge. That, and what the data and
        augmentation code judge, and the rules across sections, are what
        launch.checks.check_config adds.
        """
        for section in (self.data, self.optim, self.accelerator):
            section.check()
        for section in (self.mesh, self.checkpoint, self.ema, self.augment, self.debug, self.watchdog):
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
