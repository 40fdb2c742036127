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
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpustream import checkpoint
from tpustream.config import Strategy
from tpustream.runtime import Runtime
from tpustream.training.epoch_order import describe_change, describe_shape, same_order

log = logging.getLogger(__name__)


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
    # ema.decay: the weight average, under the model's keys (None without one).
    ema: Any = None
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
        ema: Any = None,
        rng: dict[str, Any],
        data_plan: dict[str, int],
        config: dict[str, Any],
        replicas: list[Any] | None = None,
        schedule_phase: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint's content (checkpoint.encode_checkpoint adds version and integrity)."""
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
            # Only with ema.decay: a run without stays in the format it had before.
            **({} if ema is None else {"ema": ema}),
            "optimizer": optimizer,
            "strategy": strategy,
            "rng": rng,
            # With several replicas: each one's generators and BatchNorm statistics (training.replicas).
            **({} if replicas is None else {"replicas": replicas}),
            "data_plan": data_plan,
            # training.schedule.SchedulePhase: the epochs the lr schedule is drawn over.
            **({} if schedule_phase is None else {"schedule_phase": schedule_phase}),
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
            ema=state.get("ema"),
            optimizer=state.get("optimizer"),
            # None where the key is absent: ddp wrote those checkpoints (holds_plain_optimizer_state).
            strategy=state.get("strategy"),
            config=state.get("config"),
            config_fingerprint=state.get("config_fingerprint"),
        )

    def finished(self, epochs: int, early_stop_patience: int) -> str | None:
        """Why this run has nothing left to train under these settings, or None.

        Either its epochs are done, or it stopped early: the last epoch was
        evaluated and the best accuracy is `early_stop_patience` evaluated
        epochs old, the condition the loop stops on. Derived, not recorded, so
        raising epochs or the patience continues the run.
        """
        if self.step != 0:
            return None  # inside an epoch, or trained and not yet evaluated
        if self.epoch >= epochs:
            return f"it already finished {self.epoch} epoch(s) (epochs={epochs})"
        last = self.history[-1] if self.history else None
        stopped_early = (
            early_stop_patience
            and last is not None
            and "val_accuracy" in last
            and last["epoch"] - self.best_epoch >= early_stop_patience
        )
        if stopped_early:
            return (
                f"it stopped early after epoch {last['epoch']}: no better validation accuracy "
                f"for {early_stop_patience} epoch(s) (early_stop_patience={early_stop_patience})"
            )
        return None

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

        Under a per-reader plan the sample order of an epoch depends on replicas
        x workers x batch; under a canonical partition on the global batch and
        the partition only (same_order). A position inside an epoch means
        nothing under another order, so the epoch's steps so far are taken
        back and trained again from its first batch. A position at an epoch's
        start or end holds under any plan.
        """
        trained = (self.data_plan or {}).get("steps_per_epoch")
        if trained and self.step >= trained:
            # Trained, not evaluated: counted in the saved plan's steps, which another shape may
            # not have (fewer replicas, more steps), where it would read as mid-epoch and retrain it.
            return self if self.step == steps_per_epoch else dataclasses.replace(self, step=steps_per_epoch)
        if not 0 < self.step < steps_per_epoch:
            return self
        if same_order(self.data_plan, data_plan):
            if self.data_plan != data_plan:
                log.info(
                    "%s stopped at step %d of epoch %d under %s; continuing at that step under %s "
                    "(the canonical partition gives every global step the same samples)",
                    source,
                    self.step,
                    self.epoch,
                    describe_shape(self.data_plan),
                    describe_shape(data_plan),
                )
            return self
        # Asked for (resume=force, or a checkpoint named by resume=URL): launch.plan refuses it otherwise.
        log.warning(
            "%s stopped at step %d of epoch %d; this run's order differs (%s), so epoch %d restarts "
            "from its first batch and the samples of its first %d step(s) are trained again",
            source,
            self.step,
            self.epoch,
            describe_change(self.data_plan, data_plan),
            self.epoch,
            self.step,
        )
        return dataclasses.replace(self, global_step=self.global_step - self.step, step=0, partial=None)


def device_values(runtime: Runtime, *values: tuple[float | list[float], torch.dtype]) -> list[torch.Tensor]:
    """Metric accumulators of shape (1,) (or (n,) for a list of n values), made on the host and copied over.

    torch.zeros(device=xla), or a 0-dim host zero copied over, is a
    constant in the next graph rather than data, and fused with whatever
    else was pending it compiled once more in epoch 1. A copied (1,)
    tensor is device data and compiles nothing (once the runtime has
    placed it as the step's outputs are placed).
    """
    tensors = [
        torch.tensor(value if isinstance(value, list) else [value], dtype=dtype).to(runtime.device)
        for value, dtype in values
    ]
    runtime.place(tensors)
    return tensors


class EpochSums:
    """One replica's running sums of the epoch in progress, on its device, from a checkpoint's partial sums.

    The master carries the partial sums of a resumed epoch; the epoch's
    reduction then adds every replica's sums to them exactly once.
    """

    def __init__(self, partial: dict[str, float] | None, runtime: Runtime):
        base = partial if (partial and runtime.is_master) else None
        self.loss_sum, self.real_count = device_values(
            runtime,
            (base["loss_sum"] if base else 0.0, torch.float32),
            (base["count"] if base else 0, torch.int32),
        )
        self.previous_seconds = partial["seconds"] if partial else 0.0
        self.previous_filled = partial["filled"] if partial else 0
        self.runtime = runtime
        self.start = time.time()

    def add(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
        """A step's mean loss over the replica batch, and the batch's real samples."""
        self.loss_sum += loss * batch["label"].shape[0]
        self.real_count += (batch["real"] > 0).sum().int()

    def seconds(self) -> float:
        """Training time of the epoch so far, before a resume included."""
        return self.previous_seconds + time.time() - self.start

    def reduced_partial(self, filled: int, tag: str) -> dict[str, float]:
        """The epoch's sums so far over all replicas (a collective), for a mid-epoch checkpoint.

        The master's accumulators already hold the sums from before a resume,
        so the all-reduce covers the whole epoch so far. 'filled' counts the
        batches the loader handed out, which may run a few prefetched batches
        ahead of training; it is a report of bad data, not used for training.
        """
        loss_total, count_total = self.runtime.all_reduce_sum([self.loss_sum, self.real_count])
        (filled_total,) = self.runtime.reduce_host_sum(tag, [filled])
        return {
            "loss_sum": float(loss_total.item()),
            "count": int(count_total.item()),
            "filled": int(filled_total) + self.previous_filled,
            "seconds": self.seconds(),
        }


class ProgressAttribute:
    """An attribute kept in its owner's TrainState (trainer.epoch is trainer.train_state.epoch)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, owner_object: Any, owner: type) -> Any:
        return self if owner_object is None else getattr(owner_object.train_state, self.name)

    def __set__(self, owner_object: Any, value: Any) -> None:
        setattr(owner_object.train_state, self.name, value)


# Strategies whose checkpoints hold the whole model's optimizer state, parameter by parameter
# in model order, and resume one another's; so does FSDP2's fsdp. A checkpoint of torch_xla's
# first FSDP (strategy=fsdp on XLA, which the launch refuses) holds each replica's optimizer
# "shards" instead: it loads, its optimizer state starting fresh.
PLAIN_LAYOUT = {Strategy.ddp.value, Strategy.spmd.value, Strategy.spmd_fsdp.value}


def holds_plain_optimizer_state(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's optimizer state is the whole model's, keyed as a plain model's optimizer."""
    written_by = state.get("strategy", Strategy.ddp.value)
    sharded = isinstance(state.get("optimizer"), dict) and "shards" in state["optimizer"]
    return written_by in PLAIN_LAYOUT or (written_by == Strategy.fsdp.value and not sharded)


def plain_optimizer_state_fits(state: dict[str, Any], strategy: Strategy, source: str) -> bool:
    """Whether a checkpoint's optimizer state fits a plain-layout run; says why not if not."""
    if holds_plain_optimizer_state(state):
        return True
    log.warning(
        "%s was written with strategy=%s; its optimizer state does not fit strategy=%s and "
        "starts fresh (model weights and training position are restored)",
        source,
        state.get("strategy"),
        strategy.value,
    )
    return False


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
