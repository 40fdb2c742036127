"""strategy=spmd and spmd_fsdp: one GSPMD program over every device of the mesh.

The trainer's step runs once per host on the whole global batch, sharded along
the mesh axis; XLA's partitioner turns it into one program per device with
the collectives it needs. ``spmd`` replicates the model (data parallel, with
BatchNorm statistics over the global batch, as one device with the whole
batch computes them); ``spmd_fsdp`` shards parameters, gradients and
optimizer state along the axis too (torch_xla's FSDPv2).

Checkpoints hold the whole model under the plain model's keys and the
optimizer state in the plain layout (tensors copied to the host come back
whole), so best.pt loads into ddp, and ddp, spmd and spmd_fsdp checkpoints
resume one another, optimizer state included.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from tpustream.runtime.spmd import SpmdRuntime, device_bytes
from tpustream.training.trainer import Trainer

log = logging.getLogger(__name__)

# What FSDPv2 inserts into the names of the modules it wraps.
WRAPPER_PREFIX = "_orig_module."


def shard_model(model: nn.Module, mesh: Any, min_params: int) -> nn.Module:
    """FSDPv2 over the mesh's "fsdp" axis: submodules of min_params+ parameters are units of their own.

    Every parameter is split along its largest dimension; a unit's output is
    sharded along the batch, which makes XLA gather each unit's weights just
    before it runs and free them after.
    """
    from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_params) if min_params else None
    # FSDPv2's backward hook on the root module fires on the output, as the
    # images need no gradient; torch warns at every run's first backward.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    return SpmdFullyShardedDataParallel(model, mesh=mesh, auto_wrap_policy=policy)


def shard_optimizer_state(optimizer: torch.optim.Optimizer, runtime: SpmdRuntime) -> None:
    """Shard each state tensor as its parameter is: no device ever holds all of it.

    A module-level function, not only the trainer's hook, so that
    bench.spmd_memory measures the placement training uses.
    """
    for param, state in optimizer.state.items():
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.device.type != "xla":
                continue
            if value.shape == param.shape and value.dim() > 0:
                runtime.shard_like_parameter(value, param.shape)
            else:
                runtime.replicate([value])


class SpmdTrainer(Trainer):
    """strategy=spmd: data parallel over the mesh, in one program."""

    # One program: one set of BatchNorm statistics, one device generator.
    per_replica_state = False

    def loss_denominator(self) -> int:
        # The step sees the global batch at once; nothing averages afterwards.
        return self.cfg.batch_size * self.runtime.num_devices

    def replica_samples(self, batch: dict[str, torch.Tensor]) -> int:
        # The step's batch is global; this host loaded its share of it.
        return batch["label"].shape[0] // self.runtime.world_size

    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        self.runtime.replicate([*model.parameters(), *model.buffers()])
        self._states_placed = False
        return model

    def run_optimizer(self) -> None:
        if not self._states_placed:
            # Primed or loaded optimizer state arrives unannotated; place it
            # as the step's outputs will be, so the first step's graph is the
            # graph of every later one.
            self.place_optimizer_state()
            self._states_placed = True
        self.runtime.optimizer_step(self.optimizer)

    def place_optimizer_state(self) -> None:
        tensors = [v for state in self.optimizer.state.values() for v in state.values()]
        self.runtime.replicate([t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"])

    def average_buffers(self) -> None:
        # One model: BatchNorm's statistics are already over the global batch.
        pass

    def split_micro_batches(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batch i takes slice i of every device's share, so no sample changes device.

        (Slices of the global batch would each live on a few devices and be
        moved around.) Each micro-batch then holds what ddp's replicas put in
        theirs.
        """
        count = self.cfg.micro_batches
        if count == 1:
            yield batch
            return
        devices, size = self.runtime.num_devices, self.cfg.batch_size // count
        for index in range(count):
            yield {
                name: tensor.unflatten(0, (devices, -1)).narrow(1, index * size, size).flatten(0, 1)
                for name, tensor in batch.items()
            }

    def model_and_optimizer_state(self) -> tuple[Any, Any]:
        return self.whole_state(self.model, "model"), self.optimizer.state_dict()

    def whole_state(self, module: nn.Module, tag: str) -> Any:
        # Sharded tensors come back whole when copied to the host.
        return {name.replace(WRAPPER_PREFIX, ""): value for name, value in module.state_dict().items()}


class SpmdFsdpTrainer(SpmdTrainer):
    """strategy=spmd_fsdp: parameters, gradients and optimizer state sharded along the mesh (FSDPv2)."""

    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        minimum = self.cfg.fsdp_wrap_min_params
        # BatchNorm's statistics stay whole on every device (FSDPv2 shards parameters only).
        self.runtime.replicate(model.buffers())
        wrapped = shard_model(model, self.runtime.mesh, minimum)
        self._states_placed = False
        if self.runtime.is_master and announce:
            log.info(
                "strategy=spmd_fsdp: FSDP units: %d (submodules of %d+ parameters, and the rest), "
                "parameters sharded over %d device(s): %.1f MB of %.1f MB on each",
                sum(isinstance(m, type(wrapped)) for m in wrapped.modules()),
                minimum,
                self.runtime.num_devices,
                device_bytes(list(wrapped.parameters())) / 1e6,
                sum(p.numel() * p.element_size() for p in wrapped.parameters()) / 1e6,
            )
        return wrapped

    def place_optimizer_state(self) -> None:
        shard_optimizer_state(self.optimizer, self.runtime)
