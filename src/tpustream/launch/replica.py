"""One replica's set-up: its data streams, model and trainer, from the run plan and its runtime."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from typing import Any

from tpustream.checkpoint import BEST, LAST, checkpoint_url, load_checkpoint
from tpustream.config import DataConfig, RuntimeKind, TrainConfig
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import describe_sharing
from tpustream.errors import ConfigError
from tpustream.launch.auto_workers import local_replicas
from tpustream.launch.checks import (
    check_replica_share,
    known_devices_per_replica,
    known_world_size,
    replica_batch_size,
)
from tpustream.launch.plan import RunPlan
from tpustream.launch.run_model import model_builder
from tpustream.launch.synthetic import make_synthetic_sources
from tpustream.logs import setup_worker_logging
from tpustream.observe.best import best_record, describe_best
from tpustream.observe.synthetic_rate import describe_synthetic
from tpustream.preemption import ignore_stop_signals

log = logging.getLogger(__name__)


def counts_fingerprint(*manifests: ShardManifest) -> str:
    """A digest of the shards and counts the epoch plan is made from."""
    digest = hashlib.sha256()
    for manifest in manifests:
        for shard in manifest.shards:
            digest.update(f"{shard.url}\0{shard.samples}\n".encode())
    return digest.hexdigest()[:16]


def check_same_counts(runtime, *manifests: ShardManifest) -> None:
    """Every replica must plan from the same counts, or their step counts differ and the pod hangs.

    One process counts per host; on a multi-host pod the hosts read one index,
    but a shard rewritten between two hosts' start-ups would still split them.
    """
    mine = counts_fingerprint(*manifests)
    everyone = runtime.all_gather_host("shard-counts", mine)
    if len(set(everyone)) > 1:
        others = sorted(set(everyone) - {mine})
        raise ConfigError(
            f"replicas planned from different shard counts (this host {mine}, others {', '.join(others)}): "
            "were shards rewritten while the pod started? Run `tpustream-index` on the shards and restart"
        )


def init_data_worker(rank: int, world_size: int, worker_id: int) -> None:
    """DataLoader worker_init_fn: logging, and no death by SIGTERM or SIGINT.

    A preempted TPU VM sends SIGTERM to every process, Ctrl-C sends SIGINT to
    the whole foreground group. Workers that died on either would fail their
    replica before it could save; instead the replica finishes its step, saves
    last.pt, and shuts its workers down itself. They are forks of a fork
    server that already ignores both (data.read.fork_server).
    """
    setup_worker_logging(rank, world_size, worker_id)
    ignore_stop_signals()  # and it dies with its replica (data.read.loader.make_loader)


def validation_data(cfg: TrainConfig) -> DataConfig:
    """The validation split's data section: no DataLoader workers for a run that never evaluates.

    eval_every=0 (without eval_only) never reads it; its workers would sit idle
    for the run, and its ring of batches in /dev/shm with them (1.2 GiB at 15
    workers for ResNet-50's 256: docs/limits.md).
    """
    if cfg.eval_every == 0 and not cfg.eval_only:
        return dataclasses.replace(cfg.data, num_workers=0)
    return cfg.data


def shard_loaders(plan: RunPlan, runtime, replica_batch: int, partition) -> tuple[Any, Any]:
    """This replica's (train, validation) ShardLoaders, workers started, their plan logged by the master.

    Started here, on this main thread, immune to stop signals: started later
    by the training loop's thread (validation's after the first epoch), a
    SIGTERM or Ctrl-C to the process group while they import torch would kill
    them and fail the replica before it saves.
    """
    from tpustream.data import ShardLoader
    from tpustream.data.read.partition import describe_balance, describe_partition

    cfg = plan.cfg
    note = describe_sharing(len(plan.train.shards), runtime.world_size, cfg.data.num_workers, partition)
    if note and runtime.is_master:
        log.warning("train: %s", note)
    # A GPU copies batches from page-locked memory asynchronously: the loader's
    # one copy of each batch, out of the workers' shared slots, goes there.
    device = getattr(runtime, "device", None)
    pin = device if device is not None and device.type == "cuda" else None

    def loader(manifest: ShardManifest, train: bool) -> ShardLoader:
        return ShardLoader.of_split(
            manifest,
            cfg.data if train else validation_data(cfg),
            batch_size=replica_batch,
            rank=runtime.rank,
            world_size=runtime.world_size,
            train=train,
            seed=cfg.seed,
            partition=partition if train else None,
            augment=cfg.augment if train else None,
            augment_group=cfg.batch_size,  # one device's batch
            worker_init_fn=functools.partial(init_data_worker, runtime.rank, runtime.world_size),
            record_ids=train and bool(cfg.debug.sample_log_dir),
            pin_device=pin,
            decode_device=device,  # data.decode=device (the native runtime's device)
        )

    train_loader, val_loader = loader(plan.train, True).start(), loader(plan.val, False).start()
    if runtime.is_master:
        layout = train_loader.layout
        log.info(
            "train: %d steps/epoch of %d x %d replica(s); %d padded, %d dropped samples per epoch; "
            "validation: %d steps, %d padded (masked)",
            layout.steps,
            layout.batch_size,
            layout.world_size,
            layout.padded_samples,
            layout.dropped_samples,
            val_loader.layout.steps,
            val_loader.layout.padded_samples,
        )
        if not cfg.eval_only:
            log.info("train order: %s", describe_partition(partition, layout.global_batch_size))
            uneven = describe_balance(partition, runtime.world_size, cfg.data.num_workers)
            if uneven:
                log.warning("%s", uneven)
    return train_loader, val_loader


def run_replica(plan: RunPlan, runtime) -> dict[str, Any]:
    """Build the data, model and trainer of one replica and train."""
    import torch

    from tpustream.data.shard_loader import close_shard_loaders
    from tpustream.observe import start_profiler
    from tpustream.observe.flops import training_flops_per_sample
    from tpustream.training import make_trainer
    from tpustream.training.epoch_report import InputLayout

    cfg = plan.cfg
    devices = runtime.local_devices
    mesh = f", driving {devices} devices as one GSPMD program" if devices > 1 else ""
    where = (runtime.rank, runtime.world_size, runtime.device, os.getpid(), mesh)
    log.info("replica %d of %d on %s (pid %d)%s", *where)
    if known_world_size(cfg) is None or known_devices_per_replica(cfg) is None:  # not checked before spawning
        check_replica_share(cfg, plan.train, runtime.world_size, runtime.local_devices)
    check_same_counts(runtime, plan.train, plan.val)
    torch.manual_seed(cfg.seed)  # reproducible initial weights (broadcast from the master anyway)
    # Device randomness (dropout and the like) differs per replica, reproducibly.
    runtime.set_rng_state(cfg.seed * 1_000_003 + runtime.rank)

    replica_batch = replica_batch_size(cfg, runtime.local_devices)
    synthetic = cfg.data.synthetic  # one batch on the device, no shards read (launch.synthetic)
    partition = None if cfg.eval_only or synthetic else plan.partition(runtime.world_size, replica_batch)
    height, width = plan.train.image_size
    build = model_builder(cfg, plan.train)
    model = build()
    # The master reports it (metrics.jsonl, MFU): counted once, on the meta device.
    model_flops = (
        training_flops_per_sample(build, (plan.train.channels, height, width)) if runtime.is_master else None
    )
    if plan.pretrained is not None and plan.resume_url is None:
        from tpustream.models.pretrained import load_pretrained

        load_pretrained(model, *plan.pretrained)
    if cfg.model.remat:
        from tpustream.models.remat import rematerialize

        blocks = rematerialize(model, cfg.model.name, xla=cfg.accelerator.runtime != RuntimeKind.native)
        if runtime.is_master:
            log.info(
                "model.remat: %d blocks of %s recompute their activations in the backward pass",
                blocks,
                cfg.model.name,
            )
    if synthetic:
        train_loader, val_loader = make_synthetic_sources(cfg, plan.train, runtime, replica_batch)
    else:
        train_loader, val_loader = shard_loaders(plan, runtime, replica_batch, partition)
    # Keep the server object alive for the whole run: torch_xla stops it when collected.
    profiler = start_profiler(cfg.debug.profiler_port, runtime.local_rank)
    try:
        resume_from = (load_checkpoint(plan.resume_url), plan.resume_url) if plan.resume_url else None
        trainer = make_trainer(
            cfg,
            plan.config_dict,
            runtime,
            model,
            train_loader,
            val_loader,
            resume_from=resume_from,
            started_at=plan.started_at,
            model_flops=model_flops,
            input_layout=InputLayout(
                shards_per_replica=len(plan.train.shards) / runtime.world_size,
                max_workers=partition.per_replica(runtime.world_size) if partition is not None else None,
                local_replicas=local_replicas(cfg),
            ),
        )
        del resume_from  # the checkpoint's tensors: the trainer has what it needs
        summary = trainer.fit()
    finally:
        if not synthetic:
            close_shard_loaders(train_loader, val_loader)
        del profiler
    if runtime.is_master and not cfg.eval_only:  # an evaluation's summary has no history
        log_finished(cfg, summary["history"])
    return summary


def log_finished(cfg: TrainConfig, history: list[dict[str, Any]]) -> None:
    """The master's last line: the epoch best.pt holds, by the weights it follows (or the synthetic rate)."""
    if cfg.data.synthetic:
        log.info("finished: %s; no checkpoints (data.synthetic)", describe_synthetic(history))
    elif (best := best_record(history, cfg.ema.select_best)) is not None:
        log.info(
            "finished: best validation accuracy %s; checkpoint %s",
            describe_best(best, cfg.ema.select_best),
            checkpoint_url(cfg.output_dir, BEST),
        )
    else:
        log.info(
            "finished without validation (eval_every=0); checkpoint %s", checkpoint_url(cfg.output_dir, LAST)
        )
