"""strategy=spmd and spmd_fsdp: one GSPMD program over every device of the mesh.

The trainer's step runs once per host on the whole global batch, split over
the mesh's batch axes (runtime.mesh); XLA's partitioner turns it into one
program per device with the collectives it needs. On a mesh of data devices
only (strategy=spmd's preset) the model is replicated (data parallel, with
BatchNorm statistics over the global batch, as one device with the whole
batch computes them); with an fsdp axis (spmd_fsdp's preset) parameters,
gradients and optimizer state are split too (torch_xla's FSDPv2), and with a
tensor axis the layers mesh.rules match are split across it as well
(training.sharding_rules).

Checkpoints hold the whole model under the plain model's keys and the
optimizer state in the plain layout (tensors copied to the host come back
whole), so best.pt loads into ddp, and ddp, spmd and spmd_fsdp checkpoints
resume one another, optimizer state included.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from tpustream.runtime.mesh import batch_partition_spec
from tpustream.runtime.spmd import SpmdRuntime, device_bytes
from tpustream.training.sharding_rules import Rule, Spec, parameter_specs, rules_of
from tpustream.training.sharding_rules import announce as announce_rules
from tpustream.training.trainer import Trainer

log = logging.getLogger(__name__)

# What FSDPv2 inserts into the names of the modules it wraps.
WRAPPER_PREFIX = "_orig_module."


def shard_model(
    model: nn.Module, runtime: SpmdRuntime, min_params: int, rules: Sequence[Rule]
) -> tuple[nn.Module, dict[nn.Parameter, Spec]]:
    """The model split over the mesh as training splits it, and each parameter's partition spec.

    Each parameter is split by the first of rules that matches it, or as
    FSDPv2 splits it, its largest dimension over fsdp (training.sharding_rules,
    which refuses what the mesh cannot split); buffers (BatchNorm's statistics)
    stay whole on every device. FSDPv2 makes submodules of min_params+
    parameters units of their own; a unit's output is split along the batch,
    which makes XLA gather each unit's weights just before it runs and free
    them after. The specs are for the optimizer state (shard_optimizer_state).
    """
    from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    specs = parameter_specs(model, runtime.mesh_shape.tensor, rules)
    runtime.replicate(model.buffers())
    # FSDPv2 leaves a parameter that already has a sharding as it is.
    for name, param in model.named_parameters():
        runtime.shard(param, specs[name])
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_params) if min_params else None
    # FSDPv2's backward hook on the root module fires on the output, as the
    # images need no gradient; torch warns at every run's first backward.
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")

    def shard_output(output: torch.Tensor, mesh: Any) -> None:
        # FSDPv2's default splits the batch over fsdp only, whole over data and slices.
        runtime.shard(output, batch_partition_spec(output.dim()))

    by_parameter = {param: specs[name] for name, param in model.named_parameters()}
    wrapped = SpmdFullyShardedDataParallel(
        model, mesh=runtime.mesh, auto_wrap_policy=policy, shard_output=shard_output
    )
    return wrapped, by_parameter


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, runtime: SpmdRuntime, specs: dict[nn.Parameter, Spec]
) -> None:
    """Shard each state tensor as its parameter is: no device ever holds all of it.

    A module-level function, not only the trainer's hook, so that
    bench.spmd_memory measures the placement training uses.
    """
    for param, state in optimizer.state.items():
        for value in state.values():
            if not isinstance(value, torch.Tensor) or value.device.type != "xla":
                continue
            if value.shape == param.shape and value.dim() > 0:
                runtime.shard(value, specs[param])
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
        """Micro-batch i takes slice i of every batch shard's part, so no sample changes device.

        (Slices of the global batch would each live on a few devices and be
        moved around.) Each micro-batch then holds what ddp's replicas put in
        theirs.
        """
        self.runtime.constrain_batch(batch)
        count = self.cfg.micro_batches
        if count == 1:
            yield batch
            return
        shape = self.runtime.mesh_shape
        shards, size = shape.batch_shards, self.cfg.batch_size * shape.tensor // count
        for index in range(count):
            yield {
                name: tensor.unflatten(0, (shards, -1)).narrow(1, index * size, size).flatten(0, 1)
                for name, tensor in batch.items()
            }

    def model_and_optimizer_state(self) -> tuple[Any, Any]:
        return self.whole_state(self.model, "model"), self.optimizer.state_dict()

    def whole_state(self, module: nn.Module, tag: str) -> Any:
        # Sharded tensors come back whole when copied to the host.
        return {name.replace(WRAPPER_PREFIX, ""): value for name, value in module.state_dict().items()}


class SpmdFsdpTrainer(SpmdTrainer):
    """Parameters, gradients and optimizer state split over the mesh's fsdp axis (FSDPv2), and the
    layers mesh.rules match over its tensor axis: strategy=spmd_fsdp, or any mesh with fsdp or
    tensor above 1."""

    def __init__(self, *args: Any, **kwargs: Any):
        # Each wrapped parameter's split (the weight average's too), for its optimizer state.
        self.parameter_specs: dict[nn.Parameter, Spec] = {}
        super().__init__(*args, **kwargs)

    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        minimum = self.cfg.fsdp_wrap_min_params
        shape = self.runtime.mesh_shape
        wrapped, specs = shard_model(model, self.runtime, minimum, rules_of(self.cfg.mesh.rules))
        self.parameter_specs.update(specs)
        self._states_placed = False
        if self.runtime.is_master and announce:
            log.info(
                "strategy=%s on a mesh of %s: FSDP units: %d (submodules of %d+ parameters, and the "
                "rest), parameters %.1f MB of %.1f MB on each device",
                self.cfg.strategy.value,
                shape.describe(),
                sum(isinstance(m, type(wrapped)) for m in wrapped.modules()),
                minimum,
                device_bytes(list(wrapped.parameters())) / 1e6,
                sum(p.numel() * p.element_size() for p in wrapped.parameters()) / 1e6,
            )
            announce_rules(specs, shape.tensor, self.cfg.model.name)
        return wrapped

    def place_optimizer_state(self) -> None:
        shard_optimizer_state(self.optimizer, self.runtime, self.parameter_specs)
