"""Everything before spawning: resolve the config, check inputs, load the splits, find the checkpoint.

Everything that can be checked without a device is checked here in the
parent, before any replica starts, so bad input costs seconds and one clear
line instead of N replicas failing (or worse, N-1 replicas waiting forever in
an all-reduce for the one that failed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from tpustream.checkpoint import FORCE_RESUME, OVERWRITE_RESUME, find_resume, read_metrics
from tpustream.checkpoint.local_tier import newer_local
from tpustream.config import SPMD_STRATEGIES, BestOf, Device, ModelLibrary, TrainConfig
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import CanonicalPartition
from tpustream.data.read.partition import choose_partition
from tpustream.data.resolve.options import SplitOptions
from tpustream.errors import ConfigError
from tpustream.launch.auto_workers import resolve_auto_workers
from tpustream.launch.checks import (
    check_accelerator_present,
    check_config,
    check_data,
    check_environment,
    check_replica_share,
    check_run_folders,
    known_devices_per_replica,
    known_world_size,
    replica_batch_size,
    resolve_config,
)
from tpustream.launch.hosts import load_split_on_this_host, runs_on_one_host
from tpustream.launch.resume_checks import (
    check_fresh_start,
    check_not_finished,
    check_per_reader_shape,
    check_resume_config,
    check_resume_fits,
    check_schedule_horizon,
    clear_interrupted_writes,
)
from tpustream.launch.run_model import meta_model, model_builder
from tpustream.launch.synthetic import synthetic_splits
from tpustream.observe.best import best_record, describe_best
from tpustream.observe.synthetic_rate import describe_synthetic, is_synthetic
from tpustream.preemption import raise_if_stop_requested

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """What every replica needs, resolved once in the parent and pickled to each child."""

    cfg: TrainConfig
    config_dict: dict[str, Any]  # the resolved config as plain data (stored in checkpoints)
    train: ShardManifest
    val: ShardManifest
    resume_url: str | None = None
    started_at: float | None = None  # when train.py started (time.time()), for set-up time
    # Why the run folder's run has nothing left to train (no replica starts), or None.
    finished: str | None = None
    # model.pretrained, checked and copied to this host: (local file, head tensors left fresh).
    pretrained: tuple[str, list[str]] | None = None
    # The data plan of the checkpoint the run resumes (its canonical partition), or None,
    # its step in its epoch, and the batch_size it was made with.
    resume_data_plan: dict[str, int] | None = None
    resume_step: int = 0
    resume_batch_size: int | None = None
    resume_own: bool = True  # the run folder's own checkpoint, not one named by resume=URL
    resume_epoch: int = 0  # the epoch resume_step is in
    # The host's folder where replicas' watchdogs report (watchdog.Reports), made by launch.
    watchdog_reports: str | None = None

    def partition(self, world_size: int, replica_batch: int) -> CanonicalPartition | None:
        """The training order's canonical partition on this shape (ConfigError where it cannot be read).

        A resumed run keeps its checkpoint's partition, on any shape with the
        global batch it began with; another global batch is an error naming
        the batch_size to set, unless under resume=force, from a checkpoint
        named by resume=URL (fine-tuning), or at an epoch's start with
        batch_size unchanged (more replicas), where the run takes a new
        partition (its epoch restarts: TrainState.under_data_plan). A
        checkpoint without one (data.streams=0, or an older run) keeps the
        per-reader plan, mid-epoch on its own shape only (the same
        exceptions); a fresh run chooses one from data.streams.
        """
        cfg = self.cfg
        workers = cfg.data.num_workers
        if self.resume_url is not None:
            saved_plan = self.resume_data_plan or {}
            saved = CanonicalPartition.from_dict(saved_plan)
            if saved is None:
                if self.resume_own and cfg.resume != FORCE_RESUME:
                    shape = {"world_size": world_size, "batch_size": replica_batch, "num_workers": workers}
                    position = (self.resume_epoch, self.resume_step)
                    check_per_reader_shape(saved_plan, *position, shape, self.resume_url)
                return None
            global_batch = replica_batch * world_size
            if saved_plan["global_batch"] == global_batch:
                saved.check_shape(world_size, replica_batch, workers)
                return saved
            batch_changed = self.resume_batch_size not in (None, cfg.batch_size)
            if self.resume_own and cfg.resume != FORCE_RESUME and (batch_changed or self.resume_step > 0):
                raise ConfigError(global_batch_error(saved_plan, world_size, replica_batch // cfg.batch_size))
            log.info(
                "the global batch changes from %d to %d: the training order takes a new canonical partition",
                saved_plan["global_batch"],
                global_batch,
            )
        shards = len(self.train.shards)
        return choose_partition(
            cfg.data.streams, world_size, replica_batch, workers, shards, cfg.data.shuffle_buffer
        )


def prepare(cfg: DictConfig, started_at: float | None = None) -> RunPlan:
    """Everything before spawning: resolve, validate, load manifests, find the checkpoint."""
    typed, plain = resolve_config(cfg)
    check_config(typed)
    check_environment()
    check_accelerator_present(typed)
    check_run_folders(typed)
    train, val = read_splits(typed, plain)
    check_model_layout(typed, train)
    resume = continued_from(typed, plain, train)
    pretrained = None
    if typed.model.wants_pretrained() and not typed.eval_only:
        if resume.get("resume_url") is None:
            pretrained = fetch_model_pretrained(typed, train)
        else:
            log.info(
                "model.pretrained=%s is not loaded: the run continues from %s",
                typed.model.pretrained,
                resume["resume_url"],
            )
    if typed.eval_only and resume.get("resume_url") is None:
        raise ConfigError(
            f"eval_only needs a checkpoint: set resume=<url>, or have one in {typed.output_dir}/checkpoints"
        )
    if typed.xla_cache_dir and typed.accelerator.device == Device.CPU:
        log.warning(
            "xla_cache_dir=%s on CPU: torch_xla's CPU client cannot load the entries it writes, "
            "so nothing is saved",
            typed.xla_cache_dir,
        )
    plan = RunPlan(typed, plain, train, val, started_at=started_at, pretrained=pretrained, **resume)
    world_size, devices = known_world_size(typed), known_devices_per_replica(typed)
    trains_shards = not (typed.eval_only or typed.data.synthetic)
    if world_size is not None and devices is not None and trains_shards and plan.finished is None:
        plan.partition(world_size, replica_batch_size(typed, devices))  # its errors, before spawning
    return plan


def read_splits(typed: TrainConfig, plain: dict[str, Any]) -> tuple[ShardManifest, ShardManifest]:
    """The training and validation splits as this host reads them (data.synthetic: stand-ins), checked."""
    options = SplitOptions.from_config(typed.data, typed.output_dir)
    # A stop requested while the splits are read (counting a large unindexed
    # bucket takes minutes) ends the run before anything starts.
    raise_if_stop_requested("while the training split was read")
    if typed.data.synthetic:
        train, val = synthetic_splits(typed, plain, options)
    else:
        train = load_split_on_this_host(typed.data.train_shards, "train", options)
        raise_if_stop_requested("while the training split was read")
        val = load_split_on_this_host(typed.data.val_shards, "validation", options)
    raise_if_stop_requested("while the validation split was read")
    check_data(typed, train, val)
    world_size, devices = known_world_size(typed), known_devices_per_replica(typed)
    if world_size is not None and devices is not None:
        check_replica_share(typed, train, world_size, devices)
    for manifest in () if typed.data.synthetic else (train, val):
        log.info(
            "%s: %d samples in %d shard(s), %dx%d images; counts from %s",
            manifest.split,
            manifest.num_samples,
            len(manifest.shards),
            *manifest.image_size,
            manifest.counts_from,
        )
    return train, val


def continued_from(typed: TrainConfig, plain: dict[str, Any], train: ShardManifest) -> dict[str, Any]:
    """The checkpoint the run continues, checked against this run, as RunPlan's resume_* fields ({}: fresh).

    data.num_workers=auto is resolved here too: a mid-epoch checkpoint's count wins.
    """
    if not typed.eval_only:
        clear_interrupted_writes(typed)
    # A synthetic run never continues one: it starts fresh (check_fresh_start guards the folder).
    resume = None if typed.data.synthetic else find_resume(typed.resume, typed.output_dir)
    if not typed.data.synthetic and typed.resume not in (None, "", OVERWRITE_RESUME):
        # checkpoint.local_dir: this host's copy of last.pt, where it is further along.
        resume = newer_local(resume, typed.checkpoint.local_dir, typed.output_dir, runs_on_one_host(typed))
    resolve_auto_workers(typed, plain, train, known_world_size(typed), resume.state if resume else None)
    if resume is None:
        if not typed.eval_only:
            check_fresh_start(typed)
        return {}
    check_resume_fits(typed, train, resume.state, resume.url)
    check_resume_config(typed, plain, resume)
    finished = check_not_finished(typed, resume)
    if finished is None:
        check_schedule_horizon(typed, resume)
    position = resume.state["position"]
    # Only these: the checkpoint's tensors are not kept, each replica reads its own copy.
    return {
        "resume_url": resume.url,
        "finished": finished,
        "resume_data_plan": resume.state.get("data_plan"),
        "resume_epoch": position["epoch"],
        "resume_step": position["step"],
        "resume_batch_size": (resume.state.get("config") or {}).get("batch_size"),
        "resume_own": resume.own,
    }


def global_batch_error(saved_plan: dict[str, int], world_size: int, devices: int) -> str:
    """What to set to continue a run on this shape with the global batch it began with."""
    global_batch = saved_plan["global_batch"]
    readers = world_size * devices
    now = f"{world_size} replica(s)" + (f" x {devices} device(s)" if devices > 1 else "")
    fix = (
        f"set batch_size={global_batch // readers} to continue it on {now}"
        if global_batch % readers == 0
        else f"it cannot be split evenly over {now}"
    )
    return (
        f"the run began with a global batch of {global_batch} (batch_size x devices x replicas) and its "
        f"order is cut for it: {fix}, or set resume=force to continue with another global batch from "
        "the start of its epoch"
    )


def check_model_layout(cfg: TrainConfig, train: ShardManifest) -> None:
    """model.remat and mesh.tensor against the model (built on the meta device), before spawning.

    A tensor axis of -1 is sized in the replica, which checks it there again.
    """
    tensor = cfg.mesh.tensor if cfg.strategy in SPMD_STRATEGIES else 1
    if not cfg.model.remat and tensor in (1, -1):
        return
    from tpustream.models.remat import check_remat
    from tpustream.training.sharding_rules import parameter_specs, rules_of

    model = meta_model(cfg, train)
    if cfg.model.remat:
        check_remat(model, cfg.model.name)
    if tensor not in (1, -1):
        parameter_specs(model, tensor, rules_of(cfg.mesh.rules))


def fetch_model_pretrained(cfg: TrainConfig, train: ShardManifest) -> tuple[str, list[str]]:
    """model.pretrained read once on this host and checked against the model (built on the meta device)."""
    from tpustream.models.pretrained import fetch_library_pretrained, fetch_pretrained, library_weights

    model = meta_model(cfg, train)
    build = model_builder(cfg, train)  # for other class counts: what follows them is the head
    library = ModelLibrary(cfg.model.library).value
    weights = library_weights(library, cfg.model.name, cfg.model.pretrained)
    if weights is None:
        return fetch_pretrained(model, cfg.model.pretrained, build)
    return fetch_library_pretrained(
        model,
        library,
        cfg.model.name,
        weights,
        num_classes=train.num_classes,
        channels=train.channels,
        options=dict(cfg.model.options),
        build=build,
    )


def read_final_metrics(output_dir: str, select_best: BestOf | str) -> dict[str, Any] | None:
    """The run's history, and the epoch best.pt holds by ema.select_best (None: nothing evaluated)."""
    history = read_metrics(output_dir)
    if not history:
        return None
    return {"history": history, "best": best_record(history, select_best), "select_best": BestOf(select_best)}


def describe_result(result: dict[str, Any], output_dir: str) -> str:
    """train.py's last line: the epoch best.pt holds (and by which weights), and where the checkpoints are.

    A synthetic run's: its rate, and that it wrote no checkpoints.
    """
    if is_synthetic(result["history"]):
        rate = describe_synthetic(result["history"])
        return f"{rate}; no checkpoints (data.synthetic), metrics in {output_dir}"
    best = result["best"]
    if best is None:  # eval_every=0
        return f"{len(result['history'])} epoch(s), no validation; checkpoints in {output_dir}"
    described = describe_best(best, result.get("select_best", BestOf.raw))
    return f"best validation accuracy {described}; checkpoints in {output_dir}"
