"""strategy=fsdp: the trainer with parameters, gradients and optimizer state sharded by torch_xla's FSDP."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch.nn as nn

from tpustream.config import Strategy
from tpustream.training.trainer import Trainer

# The package's name, not this module's: log lines read "tpustream.training" as
# they did before training/ was split (tests and the docs match it).
log = logging.getLogger("tpustream.training")


class FsdpTrainer(Trainer):
    """strategy=fsdp: torch_xla's FSDP shards parameters, gradients and optimizer state over replicas.

    Checkpoints hold the whole model, consolidated on the master (best.pt loads
    into the plain model, and resumes under any strategy or world size), and
    every replica's optimizer shard, used when resuming at the same world size.
    """

    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel
        from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy

        minimum = self.cfg.fsdp_wrap_min_params
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=minimum) if minimum else None
        # flatten_parameters=False: one shard per parameter, which keeps its
        # original size, so build_optimizer can still leave norms and biases
        # out of weight decay.
        wrapped = XlaFullyShardedDataParallel(model, flatten_parameters=False, auto_wrap_policy=policy)
        if self.runtime.is_master and announce:
            units = sum(isinstance(m, XlaFullyShardedDataParallel) for m in wrapped.modules())
            log.info(
                "strategy=fsdp: FSDP units: %d (submodules of %d+ parameters, and the rest), "
                "parameters sharded over %d replica(s)",
                units,
                minimum,
                self.runtime.world_size,
            )
        return wrapped

    def run_optimizer(self) -> None:
        # FSDP reduce-scattered and averaged the gradient shards in backward;
        # xm.optimizer_step would all-reduce them once more.
        self.optimizer.step()

    def model_and_optimizer_state(self) -> tuple[Any, Any]:
        from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

        shards = self.runtime.gather_state_to_master(
            f"fsdp-state-{self.global_step}-{self.step}",
            {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
        )
        if shards is None:  # not the master
            return None, None
        model = consolidate_sharded_state_dicts([s["model"] for s in shards], self.model.get_shard_metadata())
        optimizer = {
            "world_size": self.runtime.world_size,
            "layout": self.shard_layout(),
            "shards": [s["optimizer"] for s in shards],
        }
        return dict(model), optimizer

    def whole_state(self, module: nn.Module, tag: str) -> Any:
        """A wrapped module's shards, consolidated on the master (None elsewhere)."""
        from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

        shards = self.runtime.gather_state_to_master(f"fsdp-{tag}", module.state_dict())
        if shards is None:  # not the master
            return None
        return dict(consolidate_sharded_state_dicts(shards, module.get_shard_metadata()))

    def shard_layout(self) -> list[str]:
        """The sharded parameters in optimizer order: optimizer shards fit only the same layout."""
        return [name for name, _ in self.model.named_parameters()]

    def load_optimizer_state(self, state: dict[str, Any], source: str) -> None:
        saved = state["optimizer"]
        fits = (
            state.get("strategy") == Strategy.fsdp.value
            and "shards" in saved  # not FSDP2's plain layout (native runtime)
            and saved["world_size"] == self.runtime.world_size
            and saved["layout"] == self.shard_layout()
        )
        if not fits:
            log.warning(
                "%s holds the optimizer state of strategy=%s on %s replica(s), sharded another way or "
                "for another world size; this run is fsdp on %d with fsdp_wrap_min_params=%d, so the "
                "optimizer starts fresh (model weights and training position are restored)",
                source,
                state.get("strategy"),
                saved.get("world_size", "any"),
                self.runtime.world_size,
                self.cfg.fsdp_wrap_min_params,
            )
            return
        self.optimizer.load_state_dict(saved["shards"][self.runtime.rank])
