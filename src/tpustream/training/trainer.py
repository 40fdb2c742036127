"""The trainer: one compiled train step, exact evaluation, best/last checkpoints.

Built once per replica. The step function touches only device tensors; the
loss is read on the host only at logging steps (through a step closure, after
the step has run) and metrics are reduced once per epoch. What a checkpoint
holds is ``state``'s, what an epoch reports is ``report``'s, the debug checks
are ``debug``'s; this module is the step, the loop and the strategy's hooks. Subclasses change
one hook (``wrap_model``, ``run_optimizer``, ``model_and_optimizer_state``, ...) to make a
variant: ``Fsdp2Trainer`` (module ``fsdp2``, ``strategy=fsdp`` on the native runtime) and
``SpmdTrainer`` / ``SpmdFsdpTrainer`` (module ``spmd``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpustream import checkpoint, preemption, progress
from tpustream.augment.transform import DeviceAugment
from tpustream.config import Precision, TrainConfig
from tpustream.observe.best import selected_accuracy
from tpustream.observe.timing import LoopTimer, reduce_breakdowns
from tpustream.runtime import Runtime
from tpustream.training.debug import DebugChecks
from tpustream.training.ema import WeightAverage, average_on_host, ema_metrics
from tpustream.training.epoch_checks import check_epoch, first_distinct
from tpustream.training.epoch_report import EpochRecord, EpochReporter, InputLayout, RateTracker
from tpustream.training.evaluate import Evaluator
from tpustream.training.normalize import Normalizer
from tpustream.training.optimizer import build_optimizer, prime_optimizer_state, set_learning_rate
from tpustream.training.periodic import itstime
from tpustream.training.replicas import average_floating_buffers, gather_replica_parts, restore_replica_part
from tpustream.training.saving import CheckpointWriter
from tpustream.training.schedule import LearningRate
from tpustream.training.source import EpochSource
from tpustream.training.state import (
    EpochSums,
    ProgressAttribute,
    TrainState,
    capture_rng,
    plain_optimizer_state_fits,
    restore_rng,
)

log = logging.getLogger(__name__)


# (verified checkpoint state, where it was read from)
ResumeFrom = tuple[dict[str, Any], str]


class Trainer:
    """One replica's training (strategy=ddp).

    Built once per replica; the same code on a TPU pod and in the simulation.
    """

    # Whether each replica's generators and BatchNorm statistics are its own (training.replicas).
    per_replica_state = True
    # The training position and sums: what last.pt saves (training.state).
    epoch = ProgressAttribute()
    step = ProgressAttribute()
    global_step = ProgressAttribute()
    partial = ProgressAttribute()
    pending_train_metrics = ProgressAttribute()
    best_accuracy = ProgressAttribute()
    best_epoch = ProgressAttribute()
    history = ProgressAttribute()

    def __init__(
        self,
        cfg: TrainConfig,
        config_dict: dict[str, Any],
        runtime: Runtime,
        model: nn.Module,
        train_loader: EpochSource,
        val_loader: EpochSource,
        resume_from: ResumeFrom | None = None,
        started_at: float | None = None,
        model_flops: int | None = None,
        input_layout: InputLayout | None = None,
    ):
        self.cfg = cfg
        self.config_dict = config_dict
        self.runtime = runtime
        self.train_state = TrainState()
        if resume_from is not None:
            # The whole model's weights, whichever strategy and world size wrote
            # them; loaded before wrap_model, so a sharding wrapper shards them,
            # and on the host: copied into XLA parameters in place, they made a
            # resumed FSDP run drift from the uninterrupted one from its second
            # step on (torch_xla 2.9, seen here).
            model.load_state_dict(resume_from[0]["model"])
        average = average_on_host(cfg.ema, model, resume_from, runtime.is_master)
        model = runtime.prepare_model(model.to(runtime.device))
        runtime.broadcast_parameters(model)  # every replica starts from the master's weights
        self.model = self.wrap_model(model)
        self.optimizer = build_optimizer(cfg, self.model)
        prime_optimizer_state(self.optimizer)
        self.normalize = Normalizer(cfg.data.mean, cfg.data.std, runtime.device)
        # augment.*: on the device, in the step, from the draws each batch carries.
        self.augment: DeviceAugment | None = None
        if cfg.augment.active():
            smoothing, mean = cfg.optim.label_smoothing, cfg.data.mean
            self.augment = DeviceAugment(
                cfg.augment, self.normalize, smoothing, group=cfg.batch_size, mean=mean
            )
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.debug = DebugChecks(cfg.debug, runtime, cfg.output_dir)
        self.evaluator = Evaluator(runtime, val_loader, self.normalize, self.debug)
        self.steps_per_epoch = train_loader.steps
        self.schedule = LearningRate(cfg, self.steps_per_epoch, runtime.world_size * runtime.local_devices)
        self.checkpoints = CheckpointWriter(cfg, runtime)
        self.reporter = EpochReporter(cfg, config_dict, runtime, started_at, model_flops, input_layout)
        self.replica_rates: list[float] = []
        # The first shards with bad data in the last pass of each split, over all replicas.
        self.bad_shards: dict[str, list[str]] = {"train": [], "validation": []}
        # What this process has run at least once (training, evaluation, an
        # epoch end): the first of each compiles its graphs.
        self._ran_once: set[str] = set()
        if resume_from is not None:
            self.restore(*resume_from)
        self.ema: WeightAverage | None = None
        if average is not None:
            average = average.to(runtime.device)
            runtime.broadcast_parameters(average)
            average = self.wrap_model(average, announce=False)
            self.ema = WeightAverage(cfg.ema, average, runtime, self.global_step)
        if resume_from is not None and self.per_replica_state:
            restore_replica_part(resume_from[0].get("replicas"), runtime, self.buffer_modules())

    # -- the step ---------------------------------------------------------------
    # One compiled step: the learning rate set, gradients zeroed, the batch augmented on
    # the device, the micro-batches' losses back-propagated (their gradients add up), the
    # optimizer run across replicas and the weight average updated. Nothing here reads a
    # value on the host. A strategy changes a hook (loss_denominator, replica_samples,
    # run_optimizer, ...); the loop around it is train_epoch.
    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 compute under precision=bf16; weights and the loss stay float32."""
        return torch.autocast(
            self.runtime.device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == Precision.bf16
        )

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of a (micro-)batch's real samples, summed and divided by the replica batch.

        Padding and filler samples weigh zero; dividing by the static
        per-replica batch size (``loss_denominator``; not the count of real
        samples, nor the micro-batch size) gives every real sample the same weight 1 /
        global_batch once the micro-batches' gradients are summed and
        xm.optimizer_step averages replicas.
        """
        with self.autocast():
            # "input": the augmented batch's (normalised and augmented already).
            inputs = batch["input"] if "input" in batch else self.normalize(batch["image"])
            logits = self.model(inputs)
        return (self.per_sample_loss(logits.float(), batch) * batch["real"]).sum() / self.loss_denominator()

    def per_sample_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy per sample: against soft targets when augment.* mixes, label-smoothed either way."""
        if self.augment is not None:
            return self.augment.loss(logits, batch)
        return F.cross_entropy(
            logits, batch["label"], reduction="none", label_smoothing=self.cfg.optim.label_smoothing
        )

    def replica_samples(self, batch: dict[str, torch.Tensor]) -> int:
        """Samples of this step that this replica loaded (its rate; the global rate sums replicas)."""
        return batch["label"].shape[0]

    def loss_denominator(self) -> int:
        """The samples one step's gradient averages over, as this replica's share: the per-replica
        batch (xm.optimizer_step averages replicas); all of it for a step over the global batch."""
        return self.cfg.batch_size

    def split_micro_batches(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """micro_batches equal slices of the replica's batch (static shapes: one graph)."""
        count = self.cfg.micro_batches
        if count == 1:
            yield batch
            return
        size = self.cfg.batch_size // count
        for index in range(count):
            yield {name: tensor.narrow(0, index * size, size) for name, tensor in batch.items()}

    def step_fn(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        set_learning_rate(self.optimizer, self.schedule(self.global_step))
        self.optimizer.zero_grad(set_to_none=True)
        if self.augment is not None:
            batch = self.augment(batch)  # the step's whole batch: pairs within each device's
        # Gradients of the micro-batches add up in .grad; the Python loop is
        # unrolled into the step's one graph.
        total = None
        for micro_batch in self.split_micro_batches(batch):
            loss = self.compute_loss(micro_batch)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        self.run_optimizer()
        self.after_optimizer_step()
        return total

    def after_optimizer_step(self) -> None:
        """Traced into the step after the update: the weight average follows the new weights."""
        if self.ema is not None:
            self.ema.update(self.model)

    # -- hooks: the strategy -------------------------------------------------
    def wrap_model(self, model: nn.Module, announce: bool = True) -> nn.Module:
        """The module the optimizer and the steps use (data parallel: the model itself).

        Also wraps the weight average's copy of the model (announce=False: no log line).
        """
        return model

    def run_optimizer(self) -> None:
        self.runtime.optimizer_step(self.optimizer)

    def model_and_optimizer_state(self) -> tuple[Any, Any]:
        """(the whole model's state_dict, the optimizer's); a collective for sharded strategies."""
        return self.model.state_dict(), self.optimizer.state_dict()

    def whole_state(self, module: nn.Module, tag: str) -> Any:
        """A module wrapped by wrap_model as the plain model's state_dict (a collective when sharded)."""
        return module.state_dict()

    def load_optimizer_state(self, state: dict[str, Any], source: str) -> None:
        if plain_optimizer_state_fits(state, self.cfg.strategy, source):
            self.optimizer.load_state_dict(state["optimizer"])

    # -- state ------------------------------------------------------------
    def data_plan(self) -> dict[str, Any]:
        """The training loader's state at the trained position: what a mid-epoch position depends on."""
        return self.train_loader.state_dict((self.epoch, self.step))

    def checkpoint_state(self) -> dict[str, Any]:
        """What last.pt and best.pt hold now (a collective)."""
        model_state, optimizer_state = self.model_and_optimizer_state()
        ema = None if self.ema is None else self.whole_state(self.ema.module, f"ema-{self.global_step}")
        tag = f"replicas-{self.global_step}"
        replicas = (
            gather_replica_parts(self.runtime, self.buffer_modules(), tag) if self.per_replica_state else None
        )
        return self.train_state.to_checkpoint(
            schedule_phase=self.schedule.phase.to_dict(),
            replicas=replicas,
            model=model_state,
            ema=ema,
            optimizer=optimizer_state,
            strategy=self.cfg.strategy.value,
            rng=capture_rng(self.runtime),
            data_plan=self.data_plan(),
            config=self.config_dict,
        )

    def restore(self, state: dict[str, Any], source: str) -> None:
        """Everything but the model weights (loaded before wrapping): optimizer, position, RNGs."""
        self.load_optimizer_state(state, source)
        saved = TrainState.from_checkpoint(state)
        restore_rng(saved.rng, self.runtime)
        # Only the position and sums: the checkpoint's tensors are not kept.
        self.train_state = saved.under_data_plan(self.data_plan(), self.steps_per_epoch, source).progress()
        self.schedule.resume(state, self.epoch + self.step / self.steps_per_epoch)
        log.info("resumed from %s at epoch %d, step %d", source, self.epoch, self.step)

    # -- loops ------------------------------------------------------------
    def _stop_agreed(self) -> bool:
        """Whether any replica received a stop request; every replica gets the same answer."""
        local = preemption.stop_requested()
        if self.runtime.world_size == 1:
            return local
        (votes,) = self.runtime.reduce_host_sum(f"stop-{self.global_step}", [1.0 if local else 0.0])
        return votes > 0

    def _first_time(self, what: str) -> bool:
        """Whether this process reaches `what` for the first time (and remember that it has)."""
        first = what not in self._ran_once
        self._ran_once.add(what)
        return first

    def _expect_first_save(self) -> None:
        """This process's first save (mid-epoch: its partial sums' reduction too) compiles its graphs."""
        if self._first_time("save"):
            progress.expect_compile("the first save")

    def _save(self, name: str, copies: tuple[str, ...] = (), then: Callable[[], None] = lambda: None) -> None:
        self._expect_first_save()
        position = (self.global_step, self.epoch, self.step)
        self.checkpoints.save(name, self.checkpoint_state, copies, position, then)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train the rest of `epoch` from self.step; raises Preempted after saving if asked to stop."""
        self.model.train()
        start_step = self.step
        self.train_loader.set_epoch(epoch, skip_batches=start_step)
        tracker = RateTracker()
        self.reporter.mark_setup_done()
        first_loop = self._first_time("train")
        sums = EpochSums(self.partial, self.runtime)
        check_every = self.stop_check_every()
        save_every = self.cfg.checkpoint.every_n_steps
        timer = LoopTimer(self.runtime.compile_seconds, self.train_loader)  # observe.timing, idle
        for index, batch in enumerate(self.runtime.device_loader(self.train_loader, timer.wait)):
            step = start_step + index
            loss = self.step_fn(batch)
            timer.wait.note_output(loss)  # XLA: the device loader learns when the device ran it, no sync
            sums.add(loss, batch)
            tracker.add(self.replica_samples(batch))
            self.global_step += 1
            progress.step_finished("a training step", epoch, step + 1)
            self.debug.watch_compiles("train", step, first=first_loop and index == 0)
            self.debug.after_train_step(self.model, self.global_step)
            if itstime(step, self.cfg.log_steps):
                lr = self.schedule(self.global_step - 1)
                closure_args = (epoch, step, self.global_step, loss, tracker, lr)
                self.runtime.add_step_closure(self.reporter.log_step, closure_args)
            if step + 1 == self.steps_per_epoch:
                continue  # the epoch's end saves and checks for stop requests
            stop = itstime(index + 1, check_every) and self._stop_agreed()
            if stop or itstime(self.global_step, save_every):
                self._expect_first_save()
                # A snapshot: the accumulators keep running either way.
                self.partial = sums.reduced_partial(self.train_loader.filled, f"partial-{self.global_step}")
                self.epoch, self.step = epoch, step + 1
                self._save(checkpoint.LAST)
                if stop:
                    self.debug.write_sample_log(self.train_loader.sample_ids, epoch, start_step, step + 1)
                    raise preemption.Preempted(f"stopped at epoch {epoch}, step {step + 1}")
        self.train_loader.raise_if_incomplete("train")
        if first_loop:  # this process's first epoch end: its reductions compile
            progress.expect_compile("the first epoch end")
        self.average_buffers()
        sample_ids = self.train_loader.sample_ids
        self.debug.after_train_epoch(self.model, self.global_step, epoch, start_step, sample_ids)
        seconds = sums.seconds()
        loss_total, count = self.runtime.all_reduce_sum([sums.loss_sum, sums.real_count])
        breakdown = timer.breakdown(*self.checkpoints.take_seconds())
        per_replica = self.runtime.all_gather_host(
            f"train-epoch-{epoch}",
            (tracker.global_rate(), self.train_loader.filled, self.train_loader.bad_shards, breakdown),
        )
        self.replica_rates = [rate for rate, *_ in per_replica]
        self.bad_shards["train"] = first_distinct(url for _, _, urls, _ in per_replica for url in urls)
        count = int(count.item())
        self.partial = None
        self.step = self.steps_per_epoch
        return {
            "train_loss": loss_total.item() / max(count, 1),
            "train_samples": count,
            "replica_steps": self.steps_per_epoch,
            "train_seconds": seconds,
            "global_rate": sum(self.replica_rates),
            "train_filled": sum(filled for _, filled, _, _ in per_replica) + sums.previous_filled,
            "lr": self.schedule(self.global_step - 1),
            **reduce_breakdowns([replica_breakdown for *_, replica_breakdown in per_replica]),
        }

    def average_buffers(self) -> None:
        """BatchNorm running statistics averaged over replicas at the epoch's end (training.replicas)."""
        average_floating_buffers(self.runtime, self.buffer_modules())

    def buffer_modules(self) -> list[nn.Module]:
        """Modules whose BatchNorm statistics each replica updates: the model and its average."""
        return [self.model] if self.ema is None else [self.model, self.ema.module]

    def should_evaluate(self, epoch: int) -> bool:
        """eval_every: every N epochs and after the last; never with 0."""
        return itstime(epoch + 1, self.cfg.eval_every, total=self.cfg.epochs)

    def stop_check_every(self) -> int:
        """Steps between stop votes: each one when alone (no collective), else checkpoint.stop_check_every."""
        return 1 if self.runtime.world_size == 1 else max(1, self.cfg.checkpoint.stop_check_every)

    def evaluate(self, epoch: int, stoppable: bool = True) -> dict[str, float]:
        """Accuracy over the whole validation split (the evaluator's), stopping on an agreed request."""
        self.reporter.mark_setup_done()
        check_every = self.stop_check_every()

        def stop(index: int) -> bool:
            return stoppable and itstime(index + 1, check_every) and self._stop_agreed()

        first = self._first_time("evaluation")
        if first:
            progress.expect_compile("the first evaluation")
        metrics = self.evaluator.run(self.model, epoch, self.autocast, stop, first)
        if metrics is not None and self.ema is not None:
            # The same graph as the model's (same structure, other values): nothing compiles.
            averaged = self.evaluator.run(self.ema.module, epoch, self.autocast, stop, False, "ema")
            metrics = None if averaged is None else {**metrics, **ema_metrics(averaged)}
        if metrics is None:
            # The epoch's training is saved with it; evaluation reruns on resume.
            self._save(checkpoint.LAST)
            raise preemption.Preempted(f"stopped while evaluating epoch {epoch}")
        self.bad_shards["validation"] = self.evaluator.bad_shards
        return metrics

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        """Record the epoch; the master writes best.pt on improvement and last.pt always."""
        check_epoch(
            epoch, metrics, self.cfg.data.max_bad_fraction, self.cfg.stop_on_nonfinite_loss, self.bad_shards
        )
        # What best.pt and early stopping follow (ema.select_best), by the rule every report reads.
        accuracy = selected_accuracy(metrics, self.cfg.ema.select_best)
        improved = accuracy is not None and accuracy > self.best_accuracy
        if improved:
            self.best_accuracy, self.best_epoch = accuracy, epoch
        first_end = self._first_time("epoch end")
        record = EpochRecord(
            epoch=epoch,
            wall_time=time.time(),
            **metrics,
            epoch_seconds=metrics["train_seconds"] + metrics.get("val_seconds", 0.0),
            setup_seconds=self.reporter.setup_seconds if first_end else None,
            model_flops_per_sample=self.reporter.model_flops,
            mfu=self.reporter.mfu(metrics["global_rate"]),
            synthetic=self.cfg.data.synthetic or None,
        )
        self.history.append(record.to_dict())
        self.reporter.report_epoch(
            record, self.best_accuracy, self.best_epoch, self.global_step, self.replica_rates
        )
        self.epoch, self.step = epoch + 1, 0
        self.pending_train_metrics = None
        # One serialisation for both: best.pt is a copy of last.pt (a hard link, a GCS server-side copy);
        # metrics.jsonl follows them, so it never names a best epoch best.pt does not hold yet.
        history = list(self.history)
        copies = (checkpoint.BEST,) if improved else ()
        self._save(checkpoint.LAST, copies, then=lambda: self.reporter.write_history(history))
        self.debug.at_epoch_end(epoch, first_end)

    def fit(self) -> dict[str, Any]:
        if self.cfg.eval_only:
            metrics = self.evaluate(max(self.epoch - 1, 0), stoppable=False)
            self.reporter.report_evaluation(self.epoch - 1, metrics)
            self.runtime.wait_device_ops()
            return {"eval": metrics}
        self.reporter.report_run_start(self.schedule.peak, self.schedule.warmup_steps)
        done = self.train_state.finished(self.cfg.epochs, self.cfg.early_stop_patience)
        if done:
            # (train.py does not start replicas for a finished run: this is for other callers.)
            log.info("nothing to do: %s", done)
        self.reporter.open(self.global_step)
        try:
            with self.checkpoints.durable_at_exit():  # a stop (exit 75) or the end: every save written
                if not done:
                    self._run_epochs()
        finally:
            self.reporter.close()
        self.debug.finish(self.global_step)  # a trace window the run did not reach the end of
        self.runtime.wait_device_ops()
        self.checkpoints.raise_if_unsaved()
        return {"best_accuracy": self.best_accuracy, "best_epoch": self.best_epoch, "history": self.history}

    def _run_epochs(self) -> None:
        patience = self.cfg.early_stop_patience
        while self.epoch < self.cfg.epochs:
            epoch = self.epoch
            if self.step < self.steps_per_epoch:
                self.pending_train_metrics = self.train_epoch(epoch)
            metrics = dict(self.pending_train_metrics)
            evaluated = self.should_evaluate(epoch)
            if evaluated:
                metrics.update(self.evaluate(epoch))
            metrics["compilations"] = self.runtime.compilations()
            self.on_epoch_end(epoch, metrics)
            if not evaluated and self._stop_agreed():
                # Evaluation is where an epoch's last step looks for stop
                # requests; without it, look here, after last.pt was written.
                raise preemption.Preempted(f"stopped after epoch {epoch}")
            # Every replica sees the same reduced accuracy, so all stop together.
            if patience and evaluated and epoch - self.best_epoch >= patience:
                log.info("early stop: no better accuracy for %d epoch(s)", patience)
                break
