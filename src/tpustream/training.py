"""The trainer: one compiled train step, exact evaluation, best/last checkpoints.

Built once per replica. The step function touches only device tensors; the
loss is read on the host only at logging steps (through a step closure, after
the step has run) and metrics are reduced once per epoch. Subclasses change
one hook (``compute_loss``, ``run_optimizer``, ...) to make a variant.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tpustream import checkpoint, storage
from tpustream.config import OptimizerName, Schedule, TrainConfig
from tpustream.data.augment import Normalizer
from tpustream.data.pipeline import CountingLoader
from tpustream.runtime import Runtime

log = logging.getLogger(__name__)


def xla_safe_scalar(value: float) -> float:
    """Nudge 0.0 and 1.0 off their exact values.

    torch_xla bakes these "special" scalars into the graph as constants while
    every other Python scalar is fed as data, so a learning rate that passes
    through exactly 0 or 1 compiles a new graph (measured: one extra compile
    each). One ulp is no numerical change.
    """
    if value == 0.0:
        return 1e-30
    if value == 1.0:
        return math.nextafter(1.0, 0.0)
    return value


@dataclass
class LRSchedule:
    """Linear warmup to the peak, then cosine decay or constant; per step."""

    peak: float
    warmup_steps: int
    total_steps: int
    kind: Schedule
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            factor = (step + 1) / self.warmup_steps
        elif self.kind == Schedule.constant or self.total_steps <= self.warmup_steps:
            factor = 1.0
        else:
            progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            factor = self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return xla_safe_scalar(self.peak * factor)


class RateTracker:
    """Samples per second: smoothed since the last report, and since the start.

    The same numbers as torch_xla's RateTracker (smoothing 0.4) that users of
    the reference scripts read, without importing torch_xla here.
    """

    def __init__(self, smoothing: float = 0.4):
        self.smoothing = smoothing
        self.start = self.last = time.time()
        self.total = self.pending = 0.0
        self.smoothed: float | None = None

    def add(self, count: float) -> None:
        self.pending += count

    def rate(self) -> float:
        now = time.time()
        if now <= self.last:
            return self.smoothed or 0.0
        current = self.pending / (now - self.last)
        if self.smoothed is not None:
            current = (1 - self.smoothing) * current + self.smoothing * self.smoothed
        self.smoothed, self.last = current, now
        self.total += self.pending
        self.pending = 0.0
        return current

    def global_rate(self) -> float:
        elapsed = time.time() - self.start
        return (self.total + self.pending) / elapsed if elapsed > 0 else 0.0


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    # No weight decay on BatchNorm and bias parameters (standard for ResNets).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if o.name == OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0)
    return torch.optim.AdamW(groups, lr=o.lr)


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state that torch creates lazily at the first step.

    Lazy creation makes the first step a different graph from every later
    one, i.e. one more compilation of the largest graph (minutes for a
    ResNet-50 on TPU). Zero state gives the same update as lazy state: SGD's
    buffer becomes 0 * momentum + grad = grad, Adam's moments start at 0.
    Zeros are made on the host: zeros made on the device would be constants
    in the first graph, not data, and change its hash all the same.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue

            def zeros(p=param):
                return torch.zeros(p.shape, dtype=p.dtype).to(p.device)

            if isinstance(optimizer, torch.optim.SGD) and group["momentum"] > 0:
                state["momentum_buffer"] = zeros()
            elif isinstance(optimizer, torch.optim.AdamW):
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = zeros()
                state["exp_avg_sq"] = zeros()


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        config_dict: dict[str, Any],
        runtime: Runtime,
        model: nn.Module,
        train_loader: CountingLoader,
        val_loader: CountingLoader,
    ):
        self.cfg = cfg
        self.config_dict = config_dict
        self.runtime = runtime
        self.model = model.to(runtime.device)
        runtime.broadcast_parameters(self.model)  # every replica starts from the master's weights
        self.optimizer = build_optimizer(cfg, self.model)
        prime_optimizer_state(self.optimizer)
        self.normalize = Normalizer(cfg.data.mean, cfg.data.std, runtime.device)
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.steps_per_epoch = len(train_loader)
        self.schedule = LRSchedule(
            peak=cfg.optim.lr,
            warmup_steps=max(1, round(cfg.optim.warmup_epochs * self.steps_per_epoch)),
            total_steps=cfg.epochs * self.steps_per_epoch,
            kind=cfg.optim.schedule,
            min_ratio=cfg.optim.min_lr_ratio,
        )
        self.output_dir = cfg.output_dir
        self.start_epoch = 0
        self.global_step = 0
        self.best_accuracy = -1.0
        self.best_epoch = -1
        self.history: list[dict[str, Any]] = []
        self.device_name = f"xla:{runtime.rank}/{runtime.world_size}"

    # -- state ------------------------------------------------------------
    def state(self, epoch: int) -> dict[str, Any]:
        return {
            "epoch": epoch,
            "global_step": self.global_step,
            "best_accuracy": self.best_accuracy,
            "best_epoch": self.best_epoch,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
            "config": self.config_dict,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.start_epoch = int(state["epoch"]) + 1
        self.global_step = int(state["global_step"])
        self.best_accuracy = float(state["best_accuracy"])
        self.best_epoch = int(state["best_epoch"])
        self.history = list(state["history"])

    # -- hooks ------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the global batch's real samples.

        Padding and filler samples weigh zero; dividing by the static batch
        size (not the count of real samples) gives every real sample the same
        weight 1 / global_batch after xm.optimizer_step averages replicas.
        """
        with torch.autocast(
            self.runtime.device.type, dtype=torch.bfloat16, enabled=self.cfg.accelerator.bf16
        ):
            logits = self.model(self.normalize(batch["image"]))
        per_sample = F.cross_entropy(
            logits.float(), batch["label"], reduction="none", label_smoothing=self.cfg.optim.label_smoothing
        )
        return (per_sample * batch["real"]).sum() / batch["real"].shape[0]

    def run_optimizer(self) -> None:
        self.runtime.optimizer_step(self.optimizer)

    def step_fn(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        lr = self.schedule(self.global_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.compute_loss(batch)
        loss.backward()
        self.run_optimizer()
        return loss.detach()

    # -- loops ------------------------------------------------------------
    def _device_zeros(self, *dtypes: torch.dtype) -> list[torch.Tensor]:
        """Metric accumulators of shape (1,), made on the host and copied over.

        torch.zeros(device=xla), or a 0-dim host zero copied over, is a
        constant in the next graph rather than data, and fused with whatever
        else was pending it compiled once more in epoch 1. A copied (1,)
        tensor is device data and compiles nothing.
        """
        return [torch.zeros(1, dtype=d).to(self.runtime.device) for d in dtypes]

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        self.train_loader.loader.dataset.set_epoch(epoch)
        tracker = RateTracker()
        loss_sum, real_count = self._device_zeros(torch.float32, torch.int32)
        start = time.time()
        step = 0
        for step, batch in enumerate(self.runtime.device_loader(self.train_loader)):
            loss = self.step_fn(batch)
            batch_size = batch["label"].shape[0]
            loss_sum += loss * batch_size
            real_count += (batch["real"] > 0).sum().int()
            tracker.add(batch_size)
            self.global_step += 1
            if step % self.cfg.log_steps == 0:
                self.runtime.add_step_closure(self._log_step, (epoch, step, loss, tracker))
            check_every = self.cfg.debug.check_sync_every
            if check_every and self.global_step % check_every == 0:
                self.runtime.add_step_closure(self._check_replicas_in_sync, (self.global_step,))
        self.train_loader.raise_if_incomplete("train")
        self.average_buffers()
        if self.cfg.debug.check_sync_every:
            self._check_replicas_in_sync(self.global_step, include_buffers=True)
        if self.cfg.debug.sample_log_dir:
            self._write_sample_log(epoch)
        seconds = time.time() - start
        loss_total, count = self.runtime.all_reduce_sum([loss_sum, real_count])
        global_rate, filled = self.runtime.reduce_host_sum(
            f"train-epoch-{epoch}", [tracker.global_rate(), self.train_loader.filled]
        )
        count = int(count.item())
        return {
            "train_loss": loss_total.item() / max(count, 1),
            "train_samples": count,
            "replica_steps": step + 1,
            "train_seconds": seconds,
            "global_rate": global_rate,
            "train_filled": int(filled),
        }

    def _write_sample_log(self, epoch: int) -> None:
        folder = self.cfg.debug.sample_log_dir
        os.makedirs(folder, exist_ok=True)
        ids = self.train_loader.sample_ids
        np.save(
            os.path.join(folder, f"train-epoch{epoch:03d}-replica{self.runtime.rank:03d}.npy"),
            np.concatenate(ids) if ids else np.empty(0, np.int64),
        )

    def average_buffers(self) -> None:
        """Average BatchNorm running statistics (floating buffers) over replicas.

        Each replica updates them from its own batches, and xm.optimizer_step
        averages gradients only; without this every replica would evaluate a
        slightly different model, and the reduced accuracy would not be the
        accuracy of the checkpoint the master saves.
        """
        if self.runtime.world_size == 1:
            return
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        for buffer, total in zip(buffers, self.runtime.all_reduce_sum(buffers), strict=True):
            buffer.copy_(total / self.runtime.world_size)

    def _check_replicas_in_sync(self, step: int, include_buffers: bool = False) -> None:
        """Stop if replicas hold different parameters.

        Called as a step closure during the epoch (tensors are computed by
        then); buffers are compared only after average_buffers, since
        BatchNorm statistics legitimately differ within an epoch.
        """
        digest = hashlib.sha256()
        tensors = (*self.model.parameters(), *(self.model.buffers() if include_buffers else ()))
        for tensor in tensors:
            digest.update(tensor.detach().cpu().numpy().tobytes())
        fingerprints = self.runtime.all_gather_host(f"sync-{step}", digest.hexdigest())
        if len(set(fingerprints)) > 1:
            # Every replica sees the same list, so all of them stop here together.
            raise RuntimeError(f"replicas diverged by step {step}: parameter fingerprints {fingerprints}")
        log.debug("step %d: all %d replicas hold identical parameters", step, len(fingerprints))

    def _log_step(self, epoch: int, step: int, loss: torch.Tensor, tracker) -> None:
        if self.runtime.is_master or log.isEnabledFor(logging.DEBUG):
            log.info(
                "Training Device=%s Epoch=%d Step=%d Loss=%.5f Rate=%.2f GlobalRate=%.2f",
                self.device_name,
                epoch,
                step,
                loss.item(),
                tracker.rate(),
                tracker.global_rate(),
            )

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        """Accuracy over the whole validation split, summed exactly over replicas."""
        self.model.eval()
        self.val_loader.loader.dataset.set_epoch(epoch)
        correct, count, loss_sum = self._device_zeros(torch.int32, torch.int32, torch.float32)
        start = time.time()
        for batch in self.runtime.device_loader(self.val_loader):
            with torch.autocast(
                self.runtime.device.type, dtype=torch.bfloat16, enabled=self.cfg.accelerator.bf16
            ):
                logits = self.model(self.normalize(batch["image"]))
            real = batch["real"] > 0
            correct += (logits.argmax(dim=1).eq(batch["label"]) & real).sum().int()
            count += real.sum().int()
            loss_sum += (
                F.cross_entropy(logits.float(), batch["label"], reduction="none") * batch["real"]
            ).sum()
        self.val_loader.raise_if_incomplete("validation")
        correct, count, loss_sum = self.runtime.all_reduce_sum([correct, count, loss_sum])
        (filled,) = self.runtime.reduce_host_sum(f"eval-epoch-{epoch}", [self.val_loader.filled])
        correct, count = int(correct.item()), int(count.item())
        return {
            "val_accuracy": correct / max(count, 1),
            "val_correct": correct,
            "val_samples": count,
            "val_loss": loss_sum.item() / max(count, 1),
            "val_seconds": time.time() - start,
            "val_filled": int(filled),
        }

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Record metrics; the master writes best.pt on improvement and last.pt always."""
        improved = metrics["val_accuracy"] > self.best_accuracy
        if improved:
            self.best_accuracy, self.best_epoch = metrics["val_accuracy"], epoch
        self.history.append({"epoch": epoch, **metrics})
        # Every replica computes the same reduced numbers; one line per epoch is enough.
        (log.info if self.runtime.is_master else log.debug)(
            "Epoch=%d train: loss=%.4f samples=%d (replica steps %d) skipped=%d GlobalRate=%.1f "
            "time=%.1fs | val: accuracy=%.2f%% (%d/%d) loss=%.4f skipped=%d | best=%.2f%% (epoch %d)",
            epoch,
            metrics["train_loss"],
            metrics["train_samples"],
            metrics["replica_steps"],
            metrics["train_filled"],
            metrics["global_rate"],
            metrics["train_seconds"],
            100 * metrics["val_accuracy"],
            metrics["val_correct"],
            metrics["val_samples"],
            metrics["val_loss"],
            metrics["val_filled"],
            100 * self.best_accuracy,
            self.best_epoch,
        )
        if improved:
            checkpoint.save_checkpoint(
                self.runtime, storage.join(self.output_dir, checkpoint.BEST), self.state(epoch)
            )
        checkpoint.save_checkpoint(
            self.runtime, storage.join(self.output_dir, checkpoint.LAST), self.state(epoch)
        )
        checkpoint.write_metrics(self.runtime, self.output_dir, self.history)

    def fit(self) -> dict[str, Any]:
        if self.cfg.eval_only:
            metrics = self.evaluate(max(self.start_epoch - 1, 0))
            log.info(
                "evaluation of the checkpoint from epoch %d: accuracy=%.2f%% (%d/%d) loss=%.4f",
                self.start_epoch - 1,
                100 * metrics["val_accuracy"],
                metrics["val_correct"],
                metrics["val_samples"],
                metrics["val_loss"],
            )
            self.runtime.wait_device_ops()
            return {"eval": metrics}
        if self.start_epoch >= self.cfg.epochs:
            log.info("nothing to do: the checkpoint already finished %d epoch(s)", self.start_epoch)
        patience = self.cfg.early_stop_patience
        for epoch in range(self.start_epoch, self.cfg.epochs):
            metrics = self.train_epoch(epoch)
            metrics.update(self.evaluate(epoch))
            metrics["compilations"] = self.runtime.compilations()
            self.on_epoch_end(epoch, metrics)
            # Every replica sees the same reduced accuracy, so all stop together.
            if patience and epoch - self.best_epoch >= patience:
                log.info("early stop: no better accuracy for %d epoch(s)", patience)
                break
        self.runtime.wait_device_ops()
        return {"best_accuracy": self.best_accuracy, "best_epoch": self.best_epoch, "history": self.history}
