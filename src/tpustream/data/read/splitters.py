"""Shard splitters for a plain ``webdataset.WebDataset``, for users who keep their own loader.

    dataset = wds.WebDataset(urls, nodesplitter=ReplicaSplitter(), workersplitter=WorkerSplitter(), ...)

They differ from webdataset's ``split_by_node`` / ``split_by_worker`` where a
TPU pod needs it: the replica comes from torch_xla when it runs (webdataset
asks torch.distributed, which xmp.spawn does not initialise, so every replica
would read every shard), every replica gets the same number of shards (a
replica with one shard more runs more steps and leaves the others waiting in
an all-reduce: the shards that do not divide evenly are left out, and said so),
and too few shards for the replicas is an error instead of an idle replica.
Equal shard counts mean equal steps only when the shards hold equal sample
counts; ``train.py``'s own pipeline plans per sample and needs no such luck.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from torch.utils.data import get_worker_info

from tpustream.errors import ConfigError
from tpustream.runtime import current_replica

log = logging.getLogger(__name__)


class ReplicaSplitter:
    """nodesplitter=: replica r of w takes shards r, r + w, ... of the first (n // w) * w shards.

    Picklable, so it reaches DataLoader workers started with "spawn".

    Args:
        rank: this replica; None: the running replica's (torch_xla, then
            torch.distributed, then the RANK environment variable).
        world_size: the replicas; None: the running job's (as rank, then WORLD_SIZE).
        drop_uneven: leave out the last n % w shards, with a warning, so that every
            replica gets as many shards; False gives the first n % w replicas one more.

    Raises:
        ConfigError: fewer shards than replicas, or a rank outside the world.
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None, drop_uneven: bool = True):
        self.rank = rank
        self.world_size = world_size
        self.drop_uneven = drop_uneven

    def __call__(self, shards: Iterable[dict]) -> Iterator[dict]:
        rank, world = current_replica() if self.rank is None or self.world_size is None else (0, 0)
        rank = rank if self.rank is None else self.rank
        world = world if self.world_size is None else self.world_size
        if not 0 <= rank < world:
            raise ConfigError(f"ReplicaSplitter: rank {rank} outside a world of {world} replicas")
        shards = list(shards)
        if len(shards) < world:
            raise ConfigError(
                f"{len(shards)} shard(s) for {world} replicas: every replica needs at least one; "
                "write smaller shards"
            )
        usable = len(shards) // world * world if self.drop_uneven else len(shards)
        if usable < len(shards) and rank == 0:
            log.warning(
                "ReplicaSplitter: %d of %d shards left out so that each of %d replicas gets %d "
                "(first left out: %s)",
                len(shards) - usable,
                len(shards),
                world,
                usable // world,
                shards[usable].get("url", shards[usable]),
            )
        yield from shards[rank:usable:world]


class WorkerSplitter:
    """workersplitter=: DataLoader worker i of n takes its replica's shards i, i + n, ...

    The worker comes from ``torch.utils.data.get_worker_info()``; outside a
    DataLoader worker every shard is kept. Workers of one replica may differ
    by a shard (their batches all reach the same replica); a worker left
    without any is allowed but logged.
    """

    def __call__(self, shards: Iterable[dict]) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = list(shards)
        if worker >= len(shards):
            log.warning(
                "WorkerSplitter: worker %d of %d has no shard (%d shards)", worker, workers, len(shards)
            )
        yield from shards[worker::workers]
