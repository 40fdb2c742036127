"""Checks before spawning: the config alone, the machine, the run folder, the data against the config.

Everything that can be checked without a device is checked in train.py's
process, before ``xmp.spawn``, so bad input costs seconds and one clear line
instead of N replicas failing (or N-1 replicas waiting forever in an
all-reduce for the one that failed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tpustream import storage
from tpustream.augment.policies import build_policy
from tpustream.config import (
    PLATFORMS,
    SPMD_STRATEGIES,
    Accelerator,
    Collectives,
    Decode,
    Device,
    MeshConfig,
    ModelLibrary,
    OptimizerName,
    Platform,
    RuntimeKind,
    Strategy,
    TrainConfig,
    TrainCrop,
)
from tpustream.config.keys import facts_of, fields_beside, is_known, keys_where
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.config_checks import check_data_config
from tpustream.data.read.layout import plan_layout
from tpustream.errors import ConfigError, StorageError
from tpustream.models import check_model_builds, check_model_config

log = logging.getLogger(__name__)


def resolve_config(cfg: DictConfig) -> tuple[TrainConfig, dict[str, Any]]:
    """Resolve interpolations (Hydra's resolvers exist only in this process) and make paths absolute."""
    try:
        OmegaConf.resolve(cfg)
        check_known_keys(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_config_error(exc)) from None
    for key in keys_where(path=True):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and value:
            OmegaConf.update(cfg, key, storage.absolute(value))
        elif OmegaConf.is_list(value):
            OmegaConf.update(
                cfg, key, [storage.absolute(v) if isinstance(v, str) else v for v in value], merge=False
            )
    platform = PLATFORMS[Accelerator(cfg.accelerator.name)]
    native = platform.runtime == RuntimeKind.native
    cfg.xla_cache_dir = None if native else resolve_xla_cache_dir(cfg.xla_cache_dir, platform.device)
    try:
        typed: TrainConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_config_error(exc)) from None
    plain = OmegaConf.to_container(cfg, enum_to_str=True)
    return typed, plain


# Where xla_cache_dir=auto keeps the persistent compile cache on TPU hosts.
DEFAULT_XLA_CACHE = "~/.cache/tpustream/xla"


def resolve_xla_cache_dir(value: str | None, device: Device | str) -> str | None:
    """xla_cache_dir as a local absolute folder, or None (off).

    auto is on for TPU only: torch_xla 2.9's CPU client writes cache entries
    it then cannot load ("Deserializing serialized executable not supported",
    measured in bench/EPOCH_TIME.md), so on CPU a cache costs writes and
    warnings and saves nothing.
    """
    if value is None or value == "":
        return None
    if value == "auto":
        return os.path.expanduser(DEFAULT_XLA_CACHE) if Device(device) == Device.TPU else None
    if storage.is_gcs(value):
        raise ConfigError(f"xla_cache_dir={value}: the compile cache must be a local folder")
    return storage.absolute(os.path.expanduser(value))


def describe_config_error(exc: OmegaConfBaseException) -> str:
    """OmegaConf's error as one line naming the key; a missing value is one no option or override set."""
    key = getattr(exc, "full_key", "") or ""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
    if exc.__class__.__name__ == "MissingMandatoryValue":
        return (
            f"{key or 'a config key'} has no value: set it, or pick a config group option that does "
            "(e.g. data=digits)"
        )
    return f"{key}: {reason}" if key and key not in reason else reason


def check_known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Every key of cfg is the schema's (config.keys, recursively); else ConfigError naming it.

    Hydra accepts ``+optim.lrr=0.1`` (an explicit add) even on a typed
    config; the schema decides what the trainer reads, so an unknown key
    would be silently ignored.
    """
    for key in cfg:
        name = f"{prefix}{key}"
        if not is_known(name):
            raise ConfigError(describe_unknown_key(name))
        if facts_of(name).free_form:
            continue
        value = cfg._get_node(key)
        if OmegaConf.is_dict(value):
            check_known_keys(value, f"{name}.")


def describe_unknown_key(name: str) -> str:
    """'unknown config key optim.lrr (known here: lr)': its section's fields that start alike, else all."""
    key = name.rsplit(".", 1)[-1]
    if name.startswith("accelerator.") and key in Platform._fields:
        return (
            f"unknown config key {name}: the accelerator option's name decides the device type, runtime "
            f"and collectives (accelerator={', '.join(a.value for a in Accelerator)})"
        )
    fields = fields_beside(name)
    close = [f for f in fields if f[:2] == key[:2]] or fields
    return f"unknown config key {name} (known here: {', '.join(close)})"


def check_override_keys(argv: list[str]) -> str | None:
    """An override of a key the schema does not have, as one line; None if every key is known.

    Hydra answers ``optim.lrr=0.1`` with a multi-line error suggesting
    ``+optim.lrr``, which the schema then refuses; train.py asks this first.
    Group choices (``data=cifar10``), additions (``+``), deletions (``~``)
    and Hydra's own keys are Hydra's to judge.
    """
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or arg.startswith(("-", "+", "~")) or key.startswith("hydra") or "." not in key:
            continue
        if "@" in key or not is_known(key.split(".")[0]) or is_known(key):
            continue
        return describe_unknown_key(key)
    return None


def check_run_dir(argv: list[str]) -> str | None:
    """Why Hydra could not create this run's folder, as one line; None if it can.

    Hydra creates ``hydra.run.dir`` (default ``outputs/<date>/<time>`` under the
    current folder) before anything of ours runs, and a failure there is its
    traceback; train.py asks this first. Interpolated values and multiruns
    are left to Hydra.
    """
    if "-m" in argv or "--multirun" in argv:
        return None
    # Another primary config may set hydra.run.dir itself: then only a value given here is ours to check.
    other_config = any(
        a.split("=")[0] in ("-cp", "-cd", "-cn", "--config-path", "--config-dir", "--config-name")
        for a in argv
    )
    value = None if other_config else "outputs"
    for arg in argv:
        key, sep, given = arg.lstrip("+").partition("=")
        if sep and key == "hydra.run.dir":
            value = given.strip("'\"")
    if value is None or "${" in value:
        return None
    folder = os.path.abspath(os.path.expanduser(value))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"hydra.run.dir={value}: {existing} is a file, not a folder; choose another hydra.run.dir"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"hydra.run.dir={value}: cannot write in {existing}; choose another hydra.run.dir"
    return None


def check_environment() -> None:
    """Environment settings we read, checked before anything uses them."""
    storage.check_environment()


def check_accelerator_present(cfg: TrainConfig) -> None:
    """accelerator=tpu or cuda on a machine without the device: say so now, not from N failed replicas."""
    if cfg.accelerator.runtime == RuntimeKind.xla and importlib.util.find_spec("torch_xla") is None:
        raise ConfigError(
            f"accelerator={cfg.accelerator.name.value} needs torch_xla, which is "
            "not installed: pip install 'tpustream[xla]' ('tpustream[tpu]' on a TPU VM), or run "
            "accelerator=cuda or cpu_eager (native PyTorch)"
        )
    if cfg.accelerator.device == Device.CUDA:
        gpus = local_gpus()
        wanted = cfg.accelerator.num_devices
        if gpus == 0:
            raise ConfigError(
                "accelerator=cuda, but PyTorch sees no GPU here (torch.cuda.device_count() is 0); "
                "use accelerator=cpu_eager or accelerator=cpu"
            )
        if wanted is not None and wanted > gpus:
            raise ConfigError(f"accelerator.num_devices={wanted}, but this machine has {gpus} GPU(s)")
        return
    if cfg.accelerator.device != Device.TPU:
        return
    from tpustream.runtime import count_tpu_chips

    if count_tpu_chips() == 0:
        raise ConfigError(
            "accelerator=tpu, but this machine has no TPU chips (none on its PCI bus); run on a TPU VM, "
            "or use accelerator=cpu"
        )


def check_run_folders(cfg: TrainConfig) -> None:
    """output_dir and log_dir exist or can be created, and take a write (local or gs://)."""
    for name, folder in (("output_dir", cfg.output_dir), ("log_dir", cfg.log_dir)):
        if not folder:
            continue
        if name == "log_dir" and storage.scheme_name(folder):
            raise ConfigError(f"log_dir={folder}: must be a local folder (replicas append to files there)")
        try:
            storage.probe_writable(folder)
        except StorageError as exc:
            raise ConfigError(f"{name}: {exc}") from None


def check_config(cfg: TrainConfig) -> None:
    """Checks that need no data and no device: each section's own (TrainConfig.check), then what the
    data, model and augmentation code judge of their sections, then the rules across sections.

    The config package is a leaf that imports none of that code, so its
    checks are called here, beside its own, all before spawning.
    """
    cfg.check()
    check_data_config(cfg.data)
    check_model_config(cfg.model)
    build_policy(cfg.augment)  # a RandAugment string timm would not read: one line naming its section
    check_runtime_and_strategy(cfg)


def check_mesh(cfg: TrainConfig) -> None:
    """mesh.* belongs to the GSPMD strategies, and fits the devices where their count is known."""
    if cfg.strategy not in SPMD_STRATEGIES:
        unused = MeshConfig()
        changed = [
            f.name
            for f in dataclasses.fields(MeshConfig)
            if getattr(cfg.mesh, f.name) != getattr(unused, f.name)
        ]
        if changed:
            raise ConfigError(
                f"mesh.{changed[0]} lays out the device mesh of strategy=spmd / spmd_fsdp; strategy="
                f"{cfg.strategy.value} has none (docs/large-models.md)"
            )
        return
    if cfg.mesh.slices > 1 and cfg.accelerator.device != Device.TPU:
        raise ConfigError(
            f"mesh.slices={cfg.mesh.slices}: multislice joins TPU slices over the data-centre network; "
            f"accelerator={cfg.accelerator.name.value} is one machine"
        )
    devices = known_devices_per_replica(cfg)
    if devices is not None:
        from tpustream.runtime.mesh import mesh_shape

        mesh_shape(cfg.mesh, cfg.strategy, devices)


# The upstream bug that makes multi-device XLA:CPU unusable for training.
CPU_COLLECTIVES_BUG = "https://github.com/pytorch/xla/issues/9089"


def check_runtime_and_strategy(cfg: TrainConfig) -> None:
    """What the accelerator's runtime (torch_xla, or PyTorch itself) and the strategy allow together.

    The accelerator's name decides its device type, runtime and collectives
    (config.choices.PLATFORMS), so only what a user can still choose is
    checked here: replicas, strategy, decoding and debugging against them.
    """
    if cfg.accelerator.runtime == RuntimeKind.native:
        _check_native(cfg)
    else:
        _check_xla_accelerator(cfg)
        if cfg.data.decode == Decode.device and not cfg.data.synthetic:
            # An XLA device has no JPEG decoder; a TPU host decodes in its workers.
            raise ConfigError(
                "data.decode=device decodes JPEGs with nvJPEG on the native runtime (accelerator=cuda, "
                "or cpu_eager to try it on the CPU); on TPUs and XLA devices use data.decode=host"
            )
    check_mesh(cfg)
    if cfg.strategy in SPMD_STRATEGIES and cfg.debug.check_sync_every:
        raise ConfigError(
            f"debug.check_sync_every compares the replicas' copies of the model; strategy="
            f"{cfg.strategy.value} runs one program with one model"
        )
    if cfg.strategy == Strategy.fsdp:
        _check_fsdp2(cfg)


def _check_fsdp2(cfg: TrainConfig) -> None:
    """strategy=fsdp: PyTorch's FSDP2, on the native runtime, and what it cannot shard."""
    if cfg.accelerator.runtime != RuntimeKind.native:
        # torch_xla's first FSDP (one process per core) was tested on one replica only;
        # FSDPv2 (spmd_fsdp) is torch_xla's way to shard a model over a host's cores.
        raise ConfigError(
            "strategy=fsdp is PyTorch's FSDP2, on the native runtime (accelerator=cuda, cpu_eager); "
            "on TPUs and XLA devices shard parameters, gradients and optimizer state with "
            "strategy=spmd_fsdp (FSDPv2, one process per host: docs/large-models.md)"
        )
    if cfg.debug.check_sync_every:
        raise ConfigError(
            "debug.check_sync_every compares whole-model replicas; under strategy=fsdp every "
            "replica holds a different shard"
        )
    if cfg.accelerator.channels_last:
        raise ConfigError(
            "accelerator.channels_last=true: FSDP2 (strategy=fsdp on the native runtime) shards "
            "contiguous parameters only (torch 2.9); set it false, or use strategy=ddp"
        )
    if cfg.optim.name in (OptimizerName.lars, OptimizerName.lamb):
        raise ConfigError(
            f"optim={cfg.optim.name.value} takes a norm of every whole parameter; under strategy=fsdp "
            "on the native runtime (FSDP2) it would see shards: use strategy=ddp, or optim=sgd/adamw"
        )


def _check_xla_accelerator(cfg: TrainConfig) -> None:
    """What xmp.spawn, the simulated pod and the GSPMD mesh each allow."""
    acc = cfg.accelerator
    if acc.collectives == Collectives.gloo:  # accelerator=cpu_pod
        if acc.num_devices is None:
            raise ConfigError("the simulated pod (accelerator=cpu_pod) needs accelerator.num_devices >= 1")
        if cfg.strategy in SPMD_STRATEGIES:
            raise ConfigError(
                f"strategy={cfg.strategy.value} runs one process over a device mesh; the simulated pod "
                "(accelerator=cpu_pod) runs strategy=ddp only: use accelerator=cpu "
                "accelerator.num_devices=N for N virtual XLA CPU devices"
            )
    elif cfg.strategy in SPMD_STRATEGIES:
        if acc.device == Device.CPU and acc.num_devices is None:
            raise ConfigError(
                f"strategy={cfg.strategy.value} on CPU needs accelerator.num_devices >= 1 "
                "(the virtual XLA CPU devices of the mesh)"
            )
        if acc.device == Device.TPU and acc.num_devices is not None:
            raise ConfigError(
                f"accelerator.num_devices={acc.num_devices}: strategy={cfg.strategy.value} drives every "
                "device of the host (null); limit devices with TPU_VISIBLE_CHIPS instead"
            )
    elif acc.device == Device.CPU and acc.num_devices not in (None, 1):
        raise ConfigError(
            f"accelerator.num_devices={acc.num_devices} on CPU with strategy={cfg.strategy.value}: XLA:CPU "
            f"collectives deadlock across processes ({CPU_COLLECTIVES_BUG}); use 1, strategy=spmd or "
            "spmd_fsdp (N devices in one process), or accelerator=cpu_pod to simulate replicas over gloo"
        )
    if acc.device == Device.TPU and acc.num_devices not in (None, 1):
        raise ConfigError(
            f"accelerator.num_devices={acc.num_devices}: xmp.spawn runs either every device "
            "of the host (null) or one (1); limit devices with TPU_VISIBLE_CHIPS instead"
        )


def _check_native(cfg: TrainConfig) -> None:
    """The native runtime (accelerator=cuda, cpu_eager): PyTorch's own devices and torch.distributed."""
    name = cfg.accelerator.name.value
    if cfg.strategy in SPMD_STRATEGIES:
        raise ConfigError(
            f"strategy={cfg.strategy.value} is torch_xla's GSPMD (accelerator=tpu, or cpu for a mesh of "
            f"virtual devices); accelerator={name} runs strategy=ddp or fsdp (PyTorch's FSDP2)"
        )
    debug = cfg.debug
    for key, on in (("debug.metrics", debug.metrics), ("debug.profiler_port", debug.profiler_port)):
        # debug.profile_steps and profile_eval_epoch trace with torch.profiler here.
        if on:
            raise ConfigError(
                f"{key} reads torch_xla's metrics and profiler server; not with accelerator={name} "
                "(PyTorch without torch_xla)"
            )


def replica_batch_size(cfg: TrainConfig, devices_per_replica: int) -> int:
    """The batch one replica loads per step: batch_size per device it drives."""
    return cfg.batch_size * devices_per_replica


def known_devices_per_replica(cfg: TrainConfig) -> int | None:
    """Devices one replica drives, if known before spawning (an spmd host's count is not, on TPU)."""
    if cfg.strategy not in SPMD_STRATEGIES:
        return 1
    return cfg.accelerator.num_devices if cfg.accelerator.device == Device.CPU else None


def check_data(cfg: TrainConfig, train: ShardManifest, val: ShardManifest) -> None:
    """The splits against the config and each other, and the model on their shapes; once, before spawning.

    What needs the number of replicas is check_replica_share's.
    """
    for manifest, key in ((train, "train_shards"), (val, "val_shards")):
        if manifest.image_size is None:
            raise ConfigError(
                f"data.{key}: the manifest says its images vary in size; train on them with "
                "data.train_crop=random_resized (and data.image_size, the crops' side)"
            )
    if train.image_size != val.image_size or train.channels != val.channels:
        raise ConfigError(
            f"train images are {train.channels}x{train.image_size}, validation images "
            f"{val.channels}x{val.image_size}; they must match"
        )
    if train.classes != val.classes:
        raise ConfigError("train and validation manifests list different classes")
    check_channel_values(cfg, train.channels)
    warn_if_upsampled(cfg, train)
    side = min(train.image_size)
    if TrainCrop(cfg.data.train_crop) == TrainCrop.pad_crop and cfg.data.crop_padding >= side:
        raise ConfigError(
            f"data.crop_padding={cfg.data.crop_padding} on {side}-pixel images: a crop could hold no "
            f"pixel of the image; use less than {side} (the CIFAR recipe pads 4 of 32)"
        )
    check_model_builds(
        cfg.model.name,
        dict(cfg.model.options),
        num_classes=train.num_classes,
        input_size=train.image_size,
        channels=train.channels,
        library=cfg.model.library,
        layer_groups=cfg.optim.layer_decay_on(),
    )


def check_replica_share(
    cfg: TrainConfig, train: ShardManifest, world_size: int, devices_per_replica: int
) -> None:
    """Each replica's share of the training split holds a batch, and the epoch's layout is possible.

    Before spawning when the replicas are known there (known_world_size), else
    in each replica once they are (a TPU pod's).
    """
    # A synthetic stand-in (data.synthetic without shards) has no samples to share out.
    if train.shards:
        share = train.num_samples // world_size
        batch = replica_batch_size(cfg, devices_per_replica)
        if batch > share:
            per_device = f" x {devices_per_replica} devices = {batch}" if devices_per_replica > 1 else ""
            raise ConfigError(
                f"batch_size={cfg.batch_size}{per_device} is larger than a replica's share of the training "
                f"split ({train.num_samples} samples / {world_size} replica(s) = {share}); lower batch_size"
            )
        plan_layout(train.num_samples, batch, world_size, cfg.data.last_batch, "train")


def check_channel_values(cfg: TrainConfig, channels: int) -> None:
    """data.mean, data.std and augment.fill give one value per channel of the images, or ConfigError.

    Checked here, not in the schema: the channel count is the data's
    (data.channels, else the manifest's). A wrong count would otherwise fail
    in every replica, at the first normalised or augmented batch.
    """
    source = f"data.channels={cfg.data.channels}" if cfg.data.channels else "the data's"
    images = f"images have {channels} channel(s) ({source})"
    # DataConfig.check has made mean and std the same length: both must change together.
    if len(cfg.data.mean) != channels:
        example = ",".join(["0.5"] * channels), ",".join(["0.25"] * channels)
        raise ConfigError(
            f"data.mean and data.std have {len(cfg.data.mean)} values, {images}: give both one value per "
            f"channel, e.g. data.mean=[{example[0]}] data.std=[{example[1]}]"
        )
    fill = cfg.augment.fill
    if fill is not None and len(fill) != channels:
        raise ConfigError(
            f"augment.fill has {len(fill)} values, {images}: give one 0..255 value per channel, "
            f"e.g. augment.fill=[{','.join(['128'] * channels)}], or null (the mean colour)"
        )


# Crops this many times the stored images' larger side, or more, get a warning.
UPSAMPLED_WARNING_FACTOR = 2


def warn_if_upsampled(cfg: TrainConfig, train: ShardManifest) -> None:
    """A warning when random-resized crops are far larger than the stored images (32 px data at 224).

    Not an error: fine-tuning a model made for 224 px on small images
    upsampled to 224 is common practice. Training one from scratch that way
    costs (224/32)^2 = 49x the compute per image for no more information, and
    nothing else would say so. With model.pretrained, the size is the weights'
    and the upsampling is that practice: no warning.
    """
    if train.stored_size is None or train.image_size is None or cfg.model.wants_pretrained():
        return
    side, stored = max(train.image_size), max(train.stored_size)
    if side < UPSAMPLED_WARNING_FACTOR * stored:
        return
    library = ModelLibrary(cfg.model.library).value
    model = f"model={cfg.model.name}" if library == "tpustream" else f"model={library} {cfg.model.name}"
    log.warning(
        "data.image_size=%d: %s is trained on %dx%d crops of images stored at %dx%d at most, each "
        "upsampled %.0fx or more; to train at the data's size, set data.image_size=%d with a model "
        "made for it (timm ViTs: model.options.img_size and patch_size)",
        side,
        model,
        side,
        side,
        *train.stored_size,
        side / stored,
        stored,
    )


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def native_processes(cfg: TrainConfig) -> int:
    """Replica processes on this machine on the native runtime (num_devices null on CUDA: every GPU)."""
    acc = cfg.accelerator
    if acc.num_devices is not None:
        return acc.num_devices
    return local_gpus() if acc.device == Device.CUDA else 1


def known_world_size(cfg: TrainConfig) -> int | None:
    """The number of replicas if it is known before spawning (not on TPU: the pod decides).

    Under strategy=spmd / spmd_fsdp a replica is a host's process (one on CPU).
    """
    acc = cfg.accelerator
    if acc.runtime == RuntimeKind.native:
        from tpustream.launch.hosts import native_hosts

        return native_hosts(native_processes(cfg)).world_size
    if acc.collectives == Collectives.gloo:
        return acc.num_devices
    if acc.device == Device.CPU or acc.num_devices == 1:
        return 1
    return None
