"""Each replica's own part of a checkpoint: its random generators and its BatchNorm statistics.

Data-parallel replicas share the weights (the master's copy is the model),
but not everything: each draws from its own device generator (dropout,
stochastic depth) and updates BatchNorm's running statistics from its own
batches until the epoch's end averages them. A checkpoint written mid-epoch
with only the master's would resume every replica with the master's, and
the run would no longer be the uninterrupted one. So checkpoints of a run
with several replicas also hold every replica's part ("replicas", in rank
order), and each replica takes its own back when the world size is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from tpustream.runtime import Runtime
from tpustream.training.state import capture_rng, restore_rng

log = logging.getLogger(__name__)


def floating_buffers(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """BatchNorm's running statistics and the like, in module order (counts left out: they agree)."""
    return [b for module in modules for b in module.buffers() if b.is_floating_point()]


def average_floating_buffers(runtime: Runtime, modules: Sequence[nn.Module]) -> None:
    """Average BatchNorm running statistics (floating buffers) over replicas, in place.

    Each replica updates them from its own batches, and xm.optimizer_step
    averages gradients only; without this every replica would evaluate a
    slightly different model, and the reduced accuracy would not be the
    accuracy of the checkpoint the master saves.
    """
    if runtime.world_size == 1:
        return
    buffers = floating_buffers(modules)
    for buffer, total in zip(buffers, runtime.all_reduce_sum(buffers), strict=True):
        buffer.copy_(total / runtime.world_size)


def gather_replica_parts(runtime: Runtime, modules: Sequence[nn.Module], tag: str) -> list[Any] | None:
    """Every replica's part, in rank order, on the master (None elsewhere, and when alone: a collective)."""
    if runtime.world_size == 1:
        return None
    part = {"rng": capture_rng(runtime), "buffers": floating_buffers(modules)}
    return runtime.gather_state_to_master(tag, part)


def restore_replica_part(parts: list[Any] | None, runtime: Runtime, modules: Sequence[nn.Module]) -> None:
    """Take this replica's part back (after the master's generators were restored for everyone).

    Another world size: the parts belong to replicas that no longer exist;
    the buffers become their average (what the epoch's end would have made
    of them) and the generators stay the master's.
    """
    if not parts:
        return
    buffers = floating_buffers(modules)
    if any(len(part["buffers"]) != len(buffers) for part in parts):
        log.warning("the checkpoint's per-replica BatchNorm statistics do not fit this model; not restored")
        return
    if len(parts) == runtime.world_size:
        own = parts[runtime.rank]
        restore_rng(own["rng"], runtime)
        values = [value.to(buffer.dtype) for value, buffer in zip(own["buffers"], buffers, strict=True)]
    else:
        values = [
            torch.stack([part["buffers"][i].double() for part in parts]).mean(0) for i in range(len(buffers))
        ]
    with torch.no_grad():
        for buffer, value in zip(buffers, values, strict=True):
            buffer.copy_(value.to(buffer.dtype).to(buffer.device))
