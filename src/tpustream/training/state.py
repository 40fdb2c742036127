"""What a checkpoint holds: ``TrainState``, its resume arithmetic, and the random generators' states.

``TrainState`` alone defines the checkpoint's content; ``checkpoint`` only
writes, verifies and reads it, and ``launch.checks`` reads a few of its keys
("position", "epoch", "history", "config", "data_plan", "model", ...) before
spawning. The keys and their meaning are the format: change them and old
checkpoints no longer resume.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpustream import checkpoint
from tpustream.runtime import Runtime

# The package's name, not this module's: log lines read "tpustream.training" as
# they did before training/ was split (tests and the README match it).
log = logging.getLogger("tpustream.training")


@dataclass
class TrainState:
    """A replica's training progress, and the rest of a checkpoint once written or read.

    The position: the next batch to train is batch `step` of epoch `epoch`;
    step == steps per epoch means "trained, not evaluated". The fields after
    `history` are set only in a state read from a checkpoint (``from_checkpoint``);
    ``to_checkpoint`` takes their current values.
    """

    epoch: int = 0
    step: int = 0
    global_step: int = 0
    # Reduced sums of the epoch in progress up to `step` ({"loss_sum", "count",
    # "filled", "seconds"}), and its train metrics once its training part is done.
    partial: dict[str, float] | None = None
    pending_train_metrics: dict[str, Any] | None = None
    best_accuracy: float = -1.0
    best_epoch: int = -1
    # One metrics.jsonl record (EpochRecord.to_dict) per finished epoch.
    history: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    data_plan: dict[str, int] | None = None
    model: Any = None
    optimizer: Any = None
    strategy: str | None = None
    config: dict[str, Any] | None = None
    config_fingerprint: str | None = None

    def to_checkpoint(
        self,
        *,
        model: Any,
        optimizer: Any,
        strategy: str,
        rng: dict[str, Any],
        data_plan: dict[str, int],
        config: dict[str, Any],
    ) -> dict[str, Any]:
        """The checkpoint's content (checkpoint.save_checkpoint adds version and integrity)."""
        return {
            "position": {"epoch": self.epoch, "step": self.step},
            "epoch": self.epoch - 1,  # the last completed (trained and evaluated) epoch
            "global_step": self.global_step,
            "partial": self.partial,
            "pending_train_metrics": self.pending_train_metrics,
            "best_accuracy": self.best_accuracy,
            "best_epoch": self.best_epoch,
            "history": self.history,
            "model": model,
            "optimizer": optimizer,
            "strategy": strategy,
            "rng": rng,
            "data_plan": data_plan,
            "config": config,
            "config_fingerprint": checkpoint.config_fingerprint(config),
        }

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> TrainState:
        """A checkpoint's content as written by to_checkpoint ("epoch" is derived from "position")."""
        return cls(
            epoch=int(state["position"]["epoch"]),
            step=int(state["position"]["step"]),
            global_step=int(state["global_step"]),
            partial=state["partial"],
            pending_train_metrics=state["pending_train_metrics"],
            best_accuracy=float(state["best_accuracy"]),
            best_epoch=int(state["best_epoch"]),
            history=list(state["history"]),
            rng=state["rng"],
            data_plan=state["data_plan"],
            model=state.get("model"),
            optimizer=state.get("optimizer"),
            # Written since strategy=fsdp exists; the ones before were all ddp.
            strategy=state.get("strategy"),
            config=state.get("config"),
            config_fingerprint=state.get("config_fingerprint"),
        )

    def progress(self) -> TrainState:
        """The position and sums only: what a trainer carries on from (not the weights)."""
        return TrainState(
            epoch=self.epoch,
            step=self.step,
            global_step=self.global_step,
            partial=self.partial,
            pending_train_metrics=self.pending_train_metrics,
            best_accuracy=self.best_accuracy,
            best_epoch=self.best_epoch,
            history=list(self.history),
        )

    def under_data_plan(self, data_plan: dict[str, int], steps_per_epoch: int, source: str) -> TrainState:
        """This state for a run under data_plan: its epoch restarted if it stopped inside one under another.

        The sample order of an epoch depends on replicas x workers x batch: a
        position inside it means nothing under another plan, so the epoch's
        steps so far are taken back and trained again from its first batch.
        A position at an epoch's start or end holds under any plan.
        """
        if not 0 < self.step < steps_per_epoch or self.data_plan == data_plan:
            return self
        log.warning(
            "%s stopped at step %d of epoch %d under %s; this run has %s, so epoch %d restarts "
            "from its first batch (the samples of its first %d steps are seen again)",
            source,
            self.step,
            self.epoch,
            self.data_plan,
            data_plan,
            self.epoch,
            self.step,
        )
        return dataclasses.replace(self, global_step=self.global_step - self.step, step=0, partial=None)


def capture_rng(runtime: Runtime) -> dict[str, Any]:
    """The states of Python's, NumPy's, torch's and the device's random generators."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            # As tensors and ints: checkpoints load with weights_only=True, which refuses numpy arrays.
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
        },
        "torch": torch.get_rng_state(),
        "xla": runtime.rng_state(),
    }


def restore_rng(rng: dict[str, Any], runtime: Runtime) -> None:
    """Set every random generator to the states capture_rng returned."""
    random.setstate(rng["python"])
    state = np.random.get_state(legacy=False)
    state["state"] = {"key": rng["numpy"]["key"].numpy().astype(np.uint32), "pos": rng["numpy"]["pos"]}
    np.random.set_state(state)
    torch.set_rng_state(rng["torch"])
    runtime.set_rng_state(int(rng["xla"]))
