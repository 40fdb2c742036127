"""strategy=fsdp under native PyTorch (accelerator=cuda, cpu_eager): PyTorch's FSDP2, ``fully_shard``.

FSDP2 turns each parameter into a DTensor sharded along its first dimension
over the replicas (no flattening, no renaming: parameter names, weight-decay
groups and optim.layer_decay work as under ddp), all-gathers a unit's weights
for its forward and backward, and reduce-scatters the gradients, averaged
over replicas, in backward.

Checkpoints are in the plain layout, as ddp writes them: the whole model and
the whole optimizer state keyed as a plain model's optimizer keys it. So
best.pt and last.pt load under any strategy, world size and runtime (XLA
included), and a plain optimizer state resumes here, resharded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from tpustream.runtime.device import map_tensors
from tpustream.training.state import plain_optimizer_state_fits
from tpustream.training.trainer import Trainer

log = logging.getLogger(__name__)


def shard_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules to shard as units of their own, children before parents, then the model.

    A submodule becomes a unit when the parameters it holds outside units
    already chosen inside it number min_params or more (torch_xla's
    size_based_auto_wrap_policy's rule, so fsdp_wrap_min_params means the
    same under both runtimes); 0: the model is one unit.
    """
    units: list[nn.Module] = []
    covered: set[int] = set()  # ids of parameters inside a chosen unit

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or not min_params:
            return
        own = [p for p in module.parameters() if id(p) not in covered]
        if sum(p.numel() for p in own) >= min_params:
            units.append(module)
            covered.update(id(p) for p in own)

    visit(model)
    return [*units, model]


def _whole(value: Any, keep: bool) -> Any:
    """value with every DTensor gathered whole, on the host (a collective each, same order everywhere).

    keep=False (not the master): the gathers still run, as every replica must
    take part, but each whole tensor is dropped at once instead of a full copy
    of the model and its optimizer state piling up in every replica's memory.
    """
    from torch.distributed.tensor import DTensor

    def whole(tensor: torch.Tensor) -> torch.Tensor | None:
        if isinstance(tensor, DTensor):
            gathered = tensor.full_tensor()  # a new tensor: .cpu() copies nothing it shares
            return gathered.cpu() if keep else None
        return tensor.detach().cpu().clone() if keep else None  # never the live buffer

    return map_tensors(whole, value)


class Fsdp2Trainer(Trainer):
    """strategy=fsdp on the native runtime: parameters, gradients and optimizer state sharded by FSDP2."""

    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.runtime.device.type, (self.runtime.world_size,))
        units = shard_units(model, self.cfg.fsdp_wrap_min_params)
        for unit in units:
            fully_shard(unit, mesh=mesh)
        if self.runtime.is_master and announce:
            log.info(
                "strategy=fsdp (FSDP2): FSDP units: %d (submodules of %d+ parameters, and the rest), "
                "parameters sharded over %d replica(s)",
                len(units),
                self.cfg.fsdp_wrap_min_params,
                self.runtime.world_size,
            )
        return model

    def run_optimizer(self) -> None:
        # FSDP2 reduce-scattered and averaged the gradients in backward.
        self.optimizer.step()

    def model_and_optimizer_state(self) -> tuple[Any, Any]:
        # Every replica gathers (collectives); the master keeps the whole state.
        keep = self.runtime.is_master
        model, optimizer = _whole(self.model.state_dict(), keep), _whole(self.optimizer.state_dict(), keep)
        return (model, optimizer) if keep else (None, None)

    def whole_state(self, module: nn.Module, tag: str) -> Any:
        state = _whole(module.state_dict(), self.runtime.is_master)
        return state if self.runtime.is_master else None

    def load_optimizer_state(self, state: dict[str, Any], source: str) -> None:
        """A plain optimizer state (ddp's, spmd's, fsdp2's), each tensor sharded like its parameter."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not plain_optimizer_state_fits(state, self.cfg.strategy, source):
            return
        saved = state["optimizer"]
        params = [p for group in self.optimizer.param_groups for p in group["params"]]

        def reshard(value: Any, param: torch.Tensor) -> Any:
            # Moment buffers have the parameter's shape; scalars (Adam's step) stay whole.
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
                whole = value.to(param.device)
                return distribute_tensor(whole, param.device_mesh, param.placements)
            return value

        resharded = {
            index: {name: reshard(value, params[int(index)]) for name, value in entry.items()}
            for index, entry in saved["state"].items()
        }
        self.optimizer.load_state_dict({**saved, "state": resharded})
