"""Resolve the config, check inputs, spawn one replica per XLA device, run each.

Order matters: everything that can be checked without a device is checked
here in the parent, before ``xmp.spawn``, so bad input costs seconds and one
clear line instead of N replicas failing (or worse, N-1 replicas waiting
forever in an all-reduce for the one that failed).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import multiprocessing
import os
import socket
import traceback
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from tpustream.checkpoint import BEST, LAST, checkpoint_url, find_resume, load_checkpoint, read_metrics
from tpustream.config import Collectives, Device, TrainConfig
from tpustream.data.manifest import ShardManifest
from tpustream.data.sharding import describe_sharing
from tpustream.data.splits import load_split
from tpustream.errors import ConfigError, TpustreamError
from tpustream.launch.checks import (
    check_accelerator_present,
    check_config,
    check_data,
    check_environment,
    check_resume_config,
    check_resume_fits,
    check_run_folders,
    known_world_size,
    resolve_config,
    split_options,
)
from tpustream.logs import setup_replica_logging, setup_worker_logging
from tpustream.models import create_model
from tpustream.preemption import Preempted, exit_with_parent, ignore_stop_signals, install_stop_handlers

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """What every replica needs, resolved once in the parent and pickled to each child."""

    cfg: TrainConfig
    config_dict: dict[str, Any]  # the resolved config as plain data (stored in checkpoints)
    train: ShardManifest
    val: ShardManifest
    resume_url: str | None
    started_at: float | None = None  # when train.py started (time.time()), for set-up time


def prepare(cfg: DictConfig, started_at: float | None = None) -> RunPlan:
    """Everything before spawning: resolve, validate, load manifests, find the checkpoint."""
    typed, plain = resolve_config(cfg)
    check_config(typed)
    check_environment()
    check_accelerator_present(typed)
    check_run_folders(typed)
    options = split_options(typed)
    train = load_split(typed.data.train_shards, "train", options)
    val = load_split(typed.data.val_shards, "validation", options)
    check_data(typed, train, val, known_world_size(typed))
    for manifest in (train, val):
        log.info(
            "%s: %d samples in %d shard(s), %dx%d images; counts from %s",
            manifest.split,
            manifest.num_samples,
            len(manifest.shards),
            *manifest.image_size,
            manifest.counts_from,
        )
    resume_url = None
    resume = find_resume(typed.resume, typed.output_dir)
    if resume is not None:
        resume_url, state = resume
        check_resume_fits(typed, train, state, resume_url)
        check_resume_config(typed, plain, state.get("config"), resume_url)
        del state, resume  # the checkpoint's tensors: each replica reads its own copy
    if typed.eval_only and resume_url is None:
        raise ConfigError(
            f"eval_only needs a checkpoint: set resume=<url>, or have one in {typed.output_dir}/checkpoints"
        )
    if typed.xla_cache_dir and typed.accelerator.device == Device.CPU:
        log.warning(
            "xla_cache_dir=%s on CPU: torch_xla's CPU client cannot load the entries it writes, "
            "so nothing is saved",
            typed.xla_cache_dir,
        )
    return RunPlan(typed, plain, train, val, resume_url, started_at)


def configure_device_environment(cfg: TrainConfig) -> None:
    """PJRT reads these when the runtime starts, i.e. in the spawned replicas."""
    device = cfg.accelerator.device.value
    previous = os.environ.get("PJRT_DEVICE")
    if previous and previous != device:
        log.warning(
            "PJRT_DEVICE=%s in the environment; accelerator=%s sets %s", previous, device.lower(), device
        )
    os.environ["PJRT_DEVICE"] = device
    if cfg.accelerator.device == Device.CPU:
        os.environ["CPU_NUM_DEVICES"] = "1"


def launch(plan: RunPlan) -> dict[str, Any] | None:
    """Spawn the replicas and wait for them; returns the final metrics of the run."""
    configure_device_environment(plan.cfg)
    if plan.cfg.accelerator.collectives == Collectives.gloo:
        spawn_simulated_pod(plan)
        return read_final_metrics(plan.cfg.output_dir)
    import torch_xla.distributed.xla_multiprocessing as xmp  # after PJRT_DEVICE is set

    acc = plan.cfg.accelerator
    # xmp.spawn accepts nprocs None (a process per device; on CPU one child
    # process) or 1 (run in this process). CPU goes through a child like TPU
    # does, so the local run exercises the pod's code path.
    single = acc.in_process or (acc.device == Device.TPU and acc.num_devices == 1)
    nprocs = 1 if single else None
    log.info(
        "launching on %s (%s); train %d samples in %d shards, validation %d samples; output %s%s",
        acc.device.value,
        "in this process" if nprocs == 1 else "one process per device",
        plan.train.num_samples,
        len(plan.train.shards),
        plan.val.num_samples,
        plan.cfg.output_dir,
        f"; resuming from {plan.resume_url}" if plan.resume_url else "",
    )
    try:
        xmp.spawn(replica_main, args=(plan,), nprocs=nprocs)
    except (TpustreamError, Preempted):
        raise
    except Exception as exc:  # a bug in a replica, or BrokenProcessPool: the replica logged why
        raise TpustreamError(
            f"a replica failed ({exc.__class__.__name__}: {exc}); its error is logged above"
        ) from exc
    return read_final_metrics(plan.cfg.output_dir)


def read_final_metrics(output_dir: str) -> dict[str, Any] | None:
    """The run's history, and its best evaluated epoch (None if nothing was evaluated)."""
    history = read_metrics(output_dir)
    if not history:
        return None
    evaluated = [m for m in history if "val_accuracy" in m]
    return {
        "history": history,
        "best": max(evaluated, key=lambda m: m["val_accuracy"]) if evaluated else None,
    }


def describe_result(result: dict[str, Any], output_dir: str) -> str:
    """train.py's last line: the best evaluated epoch, and where the checkpoints are."""
    best = result["best"]
    if best is None:  # eval_every=0
        return f"{len(result['history'])} epoch(s), no validation; checkpoints in {output_dir}"
    return (
        f"best validation accuracy {100 * best['val_accuracy']:.2f}% "
        f"({best['val_correct']}/{best['val_samples']}) at epoch {best['epoch']}; checkpoints in {output_dir}"
    )


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


def init_data_worker(rank: int, world_size: int, replica_pid: int, worker_id: int) -> None:
    """DataLoader worker_init_fn: logging, and no death by SIGTERM or SIGINT.

    A preempted TPU VM sends SIGTERM to every process, Ctrl-C sends SIGINT to
    the whole foreground group. Workers that died on either would fail their
    replica before it could save; instead the replica finishes its step, saves
    last.pt, and shuts its workers down itself. Workers start with these
    signals blocked (CountingLoader), so one sent while they start waits here.
    """
    setup_worker_logging(rank, world_size, worker_id)
    ignore_stop_signals()
    exit_with_parent(parent=replica_pid)


def run_replica(plan: RunPlan, runtime) -> dict[str, Any]:
    """Build the data, model and trainer of one replica and train."""
    import torch

    from tpustream.data.loader import ShardStream, make_loader
    from tpustream.observe import start_profiler
    from tpustream.training import make_trainer

    cfg = plan.cfg
    log.info("replica %d of %d on %s (pid %d)", runtime.rank, runtime.world_size, runtime.device, os.getpid())
    check_data(cfg, plan.train, plan.val, runtime.world_size)
    check_same_counts(runtime, plan.train, plan.val)
    note = describe_sharing(len(plan.train.shards), runtime.world_size, cfg.data.num_workers)
    if note and runtime.is_master:
        log.warning("train: %s", note)
    torch.manual_seed(cfg.seed)  # reproducible initial weights (broadcast from the master anyway)
    # Device randomness (dropout and the like) differs per replica, reproducibly.
    runtime.set_rng_state(cfg.seed * 1_000_003 + runtime.rank)

    def stream(manifest: ShardManifest, train: bool) -> ShardStream:
        return ShardStream(
            manifest,
            batch_size=cfg.batch_size,
            rank=runtime.rank,
            world_size=runtime.world_size,
            num_workers=cfg.data.num_workers,
            train=train,
            seed=cfg.seed,
            shuffle_buffer=cfg.data.shuffle_buffer,
            last_batch=cfg.data.last_batch,
            on_error=cfg.data.on_error,
            train_crop=cfg.data.train_crop,
            crop_padding=cfg.data.crop_padding,
            eval_crop_ratio=cfg.data.eval_crop_ratio,
            hflip=cfg.data.hflip,
            in_memory=cfg.data.in_memory,
            image_key=cfg.data.image_key,
            label_key=cfg.data.label_key,
            stages=cfg.data.stages,
        )

    train_stream, val_stream = stream(plan.train, True), stream(plan.val, False)
    if runtime.is_master:
        layout = train_stream.layout
        log.info(
            "train: %d steps/epoch of %d x %d replica(s); %d padded, %d dropped samples per epoch; "
            "validation: %d steps, %d padded (masked)",
            layout.steps,
            layout.batch_size,
            layout.world_size,
            layout.padded_samples,
            layout.dropped_samples,
            val_stream.layout.steps,
            val_stream.layout.padded_samples,
        )
    worker_init = functools.partial(init_data_worker, runtime.rank, runtime.world_size, os.getpid())
    height, width = plan.train.image_size
    model = create_model(
        cfg.model.name,
        num_classes=plan.train.num_classes,
        image_size=max(height, width),
        channels=plan.train.channels,
        **cfg.model.options,
    )
    train_loader = make_loader(
        train_stream,
        cfg.data.num_workers,
        cfg.data.prefetch_factor,
        worker_init_fn=worker_init,
        record_ids=bool(cfg.debug.sample_log_dir),
    )
    val_loader = make_loader(
        val_stream, cfg.data.num_workers, cfg.data.prefetch_factor, worker_init_fn=worker_init
    )
    # Both loaders' workers start here, on this main thread, immune to stop
    # signals: started later by the training loop's thread (validation's after
    # the first epoch), a SIGTERM or Ctrl-C to the process group while they
    # import torch would kill them and fail the replica before it saves.
    train_loader.start_workers()
    val_loader.start_workers()
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
        )
        del resume_from  # the checkpoint's tensors: the trainer has what it needs
        summary = trainer.fit()
    finally:
        train_loader.close()
        val_loader.close()
        del profiler
    if runtime.is_master and not cfg.eval_only:
        if summary["best_epoch"] >= 0:
            log.info(
                "finished: best validation accuracy %.2f%% at epoch %d; checkpoint %s",
                100 * summary["best_accuracy"],
                summary["best_epoch"],
                checkpoint_url(cfg.output_dir, BEST),
            )
        else:
            log.info(
                "finished without validation (eval_every=0); checkpoint %s",
                checkpoint_url(cfg.output_dir, LAST),
            )
    return summary


def replica_main(index: int, plan: RunPlan) -> None:
    """The xmp.spawn target: one replica, from its device set-up to the end of training."""
    import torch_xla.runtime as xr

    from tpustream.runtime import XlaRuntime

    world = xr.world_size()
    setup_replica_logging(xr.global_ordinal(), world, plan.cfg.log_dir)
    install_stop_handlers()  # effective only if this replica runs on its process's main thread
    if multiprocessing.parent_process() is not None:  # a spawned child, not train.py itself
        exit_with_parent()
    try:
        run_replica(plan, XlaRuntime(plan.cfg.xla_cache_dir))
    except Preempted:
        raise  # every replica stopped at the same step after the save: nobody waits for us
    except BaseException as exc:
        if not isinstance(exc, TpustreamError):
            # A bug, not bad input: keep the traceback, the parent only sees the type.
            log.error("replica %d failed:\n%s", index, traceback.format_exc())
        if world == 1:
            raise  # nobody waits for us; the parent reports our one-line error
        if isinstance(exc, TpustreamError):
            log.error("replica %d failed: %s", index, exc)
        # Peers may be waiting in a collective for this replica and would wait
        # forever. Dying hard breaks xmp.spawn's process pool, which then
        # terminates every replica of this host.
        logging.shutdown()
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_simulated_pod(plan: RunPlan) -> None:
    """accelerator=cpu_pod: one process per replica on this machine, collectives over gloo.

    If a replica fails, torch.multiprocessing terminates the others (which may
    be waiting for it in an all-reduce) and raises here.
    """
    import torch.multiprocessing as mp

    world = plan.cfg.accelerator.num_devices
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    log.info(
        "launching a simulated pod of %d replica processes (XLA CPU + gloo); train %d samples in %d "
        "shards, validation %d samples; output %s%s",
        world,
        plan.train.num_samples,
        len(plan.train.shards),
        plan.val.num_samples,
        plan.cfg.output_dir,
        f"; resuming from {plan.resume_url}" if plan.resume_url else "",
    )
    try:
        mp.start_processes(
            simulated_replica_main, args=(plan, world, init_method), nprocs=world, start_method="spawn"
        )
    except mp.ProcessRaisedException as exc:
        # The replica logged its error; its last traceback line names it.
        last = str(exc).strip().splitlines()[-1]
        error, _, message = last.partition(": ")
        if error == "tpustream.preemption.Preempted":
            raise Preempted(message) from None
        if error.startswith("tpustream.errors."):
            raise TpustreamError(f"replica {exc.error_index}: {message}") from None
        raise TpustreamError(
            f"replica {exc.error_index} failed ({last}); its traceback is logged above"
        ) from None
    except mp.ProcessExitedException as exc:
        raise TpustreamError(f"replica {exc.error_index} exited with code {exc.exit_code}") from None


def simulated_replica_main(rank: int, plan: RunPlan, world: int, init_method: str) -> None:
    """One replica of the simulated pod: gloo process group, own XLA CPU device, shared trainer code."""
    import torch.distributed as dist

    from tpustream.runtime import GlooRuntime

    setup_replica_logging(rank, world, plan.cfg.log_dir)
    install_stop_handlers()
    exit_with_parent()
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )
    try:
        run_replica(plan, GlooRuntime(rank, world, plan.cfg.xla_cache_dir))
    except Preempted:
        raise
    except TpustreamError as exc:
        log.error("replica %d failed: %s", rank, exc)
        raise
    except BaseException:
        log.error("replica %d failed:\n%s", rank, traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
