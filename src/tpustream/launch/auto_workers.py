"""data.num_workers=auto: the worker count, chosen in train.py's process before any replica starts.

How: the training pipeline (read, decode, crop, augmentation draws) runs in
this process for a moment, giving the samples/s one worker delivers here, on
these shards. What a replica's device takes is known ahead only on a TPU whose
chip type and the model's FLOPs are known: the chip's peak at an optimistic
AUTO_MFU. Workers = that demand over one worker's rate, with the advice's
margin; never more than the vCPUs this host can spare per replica (one each
is left for the replicas' own loops: observe.advice.host_worker_cap, the
advice's cap too), nor than a replica's shards (more
workers would split shards by sample ranges), nor MAX_AUTO_WORKERS (each holds
a shuffle buffer). Where the demand is unknown (CPU, GPU) it is what the host
can spare, within the same caps. A run that resumes mid-epoch without
canonical streams keeps the count its checkpoint was written with: its order
continues on no other (launch.resume_checks.check_per_reader_shape).
The choice and its reasons are logged in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from tpustream.config import Device, RuntimeKind, TrainConfig
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.read.layout import CanonicalPartition
from tpustream.observe.advice import WORKER_MARGIN, host_worker_cap, usable_cpus
from tpustream.observe.chips import Chip

log = logging.getLogger(__name__)

AUTO = "auto"
# The share of the chip's peak the demand estimate assumes the step reaches.
AUTO_MFU = 0.5
MAX_AUTO_WORKERS = 8
# How long this process runs the pipeline to measure one worker's rate.
MEASURE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class WorkerChoice:
    workers: int
    why: str


def choose_workers(
    *,
    worker_rate: float,
    demand: float | None,
    cpus: int,
    local_replicas: int,
    shards_per_replica: float,
) -> WorkerChoice:
    """The count, from one worker's measured samples/s and a replica's demand (None: unknown)."""
    # The advice's cap, so that auto never picks what the advice would call too many.
    spare = host_worker_cap(cpus, local_replicas)
    caps = {
        f"{spare} spare vCPU(s) per replica": spare,
        f"{shards_per_replica:g} shard(s) per replica": max(1, math.floor(shards_per_replica)),
        f"at most {MAX_AUTO_WORKERS}": MAX_AUTO_WORKERS,
    }
    if demand is None:
        wanted, reason = spare, "the device's demand is unknown here: what the host can spare"
    else:
        wanted = max(1, math.ceil(demand * WORKER_MARGIN / max(worker_rate, 1e-9)))
        reason = f"{demand:.0f} samples/s per replica at {AUTO_MFU:.0%} MFU over {worker_rate:.0f} per worker"
    limit, name = min((value, key) for key, value in caps.items())
    workers = min(wanted, limit)
    capped = f"; capped by {name}" if wanted > limit else ""
    return WorkerChoice(workers, f"{reason}{capped}")


def replica_demand(flops_per_sample: float | None, chip: Chip | None) -> float | None:
    """Samples/s one replica's device takes at AUTO_MFU of its chip's peak (None: unknown)."""
    if not flops_per_sample or chip is None:
        return None
    return chip.peak_flops / chip.devices_per_chip * AUTO_MFU / flops_per_sample


def measure_worker_rate(cfg: TrainConfig, train: ShardManifest, seconds: float = MEASURE_SECONDS) -> float:
    """Samples/s of the training pipeline in this one process (what one worker delivers).

    The first batch is left out: it fills the shuffle buffer and opens the first shard.
    """
    from tpustream.data import ShardLoader

    loader = ShardLoader.of_split(
        train,
        dataclasses.replace(cfg.data, num_workers=0),
        batch_size=cfg.batch_size,
        rank=0,
        world_size=1,
        train=True,
        seed=cfg.seed,
        partition=None,
        augment=cfg.augment,
    )
    samples, start = 0, None
    for batch in loader:
        if start is None:
            start = time.perf_counter()
            continue
        samples += int(batch["label"].shape[0])
        if time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start if start is not None else 0.0
    return samples / elapsed if samples and elapsed > 0 else float("inf")


def local_replicas(cfg: TrainConfig) -> int:
    """Replica processes on this host (a TPU host's count from its chips)."""
    from tpustream.config import SPMD_STRATEGIES, Collectives
    from tpustream.launch.checks import native_processes

    acc = cfg.accelerator
    if acc.runtime == RuntimeKind.native:
        return native_processes(cfg)
    if cfg.strategy in SPMD_STRATEGIES:
        return 1
    if acc.collectives == Collectives.gloo:
        return acc.num_devices or 1
    if acc.device == Device.TPU and acc.num_devices is None:
        from tpustream.runtime import count_tpu_chips, host_chip

        chip = host_chip()
        return max(1, count_tpu_chips() * (chip.devices_per_chip if chip else 1))
    return 1


def resolve_auto_workers(
    cfg: TrainConfig,
    plain: dict[str, Any],
    train: ShardManifest,
    world_size: int | None,
    resume_state: dict[str, Any] | None,
) -> None:
    """Replace data.num_workers=auto by a count in both forms of the config, as if typed; logs why."""
    if cfg.data.num_workers != AUTO:
        return
    cfg.data.num_workers = plain["data"]["num_workers"] = _choose(cfg, train, world_size, resume_state)


def _choose(
    cfg: TrainConfig, train: ShardManifest, world_size: int | None, resume_state: dict[str, Any] | None
) -> int:
    saved_plan = (resume_state or {}).get("data_plan") or {}
    partition = CanonicalPartition.from_dict(saved_plan)
    if resume_state is not None and resume_state["position"]["step"] > 0 and partition is None:
        # A per-reader order continues mid-epoch only with the same workers.
        saved = saved_plan.get("num_workers")
        if saved is not None:
            log.info("data.num_workers=auto: %d, as the mid-epoch checkpoint this run resumes", saved)
            return int(saved)
    chip = None
    flops = None
    if cfg.accelerator.device == Device.TPU:
        from tpustream.runtime import host_chip

        chip = host_chip()
        if chip is not None:
            flops = _model_flops(cfg, train)
    # Served from memory there is nothing to decode: the rate would only measure the loading.
    rate = float("inf") if cfg.data.in_memory else measure_worker_rate(cfg, train)
    replicas = local_replicas(cfg)
    shards = len(train.shards) / (world_size or replicas)
    choice = choose_workers(
        worker_rate=rate,
        demand=replica_demand(flops, chip),
        cpus=usable_cpus(),
        local_replicas=replicas,
        shards_per_replica=shards,
    )
    delivers = "" if math.isinf(rate) else f"one worker delivers {rate:.0f} samples/s here; "
    workers, why = choice.workers, choice.why
    if partition is not None and world_size and workers > partition.per_replica(world_size):
        workers = max(1, partition.per_replica(world_size))
        why += f"; at most {workers}, the canonical streams each replica reads"
    log.info("data.num_workers=auto: %d (%s%s)", workers, delivers, why)
    return workers


def _model_flops(cfg: TrainConfig, train: ShardManifest) -> int | None:
    from tpustream.launch.run_model import model_builder
    from tpustream.observe.flops import training_flops_per_sample

    height, width = train.image_size
    return training_flops_per_sample(model_builder(cfg, train), (train.channels, height, width))
