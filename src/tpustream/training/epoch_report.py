"""What a run reports: one typed ``EpochRecord`` per epoch, and where it goes.

``EpochReporter`` writes each record to the log, to TensorBoard and (the
history) to metrics.jsonl, and logs the training steps in between. The same
record type reads the history back: from metrics.jsonl (``read_epoch_records``,
bench/epoch_time/) and from a checkpoint's "history" (scripts/demo.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tpustream import checkpoint, observe
from tpustream.config import Decode, Device, TrainConfig, TrainCrop
from tpustream.errors import StorageError
from tpustream.observe.advice import SavingSettings, advise, process_epochs, usable_cpus
from tpustream.observe.chips import chip_from_accelerator_type, mfu
from tpustream.observe.flops import TRAINING_FACTOR
from tpustream.observe.timing import process_token
from tpustream.runtime import Runtime

log = logging.getLogger(__name__)


# TensorBoard tag -> EpochRecord field, for the fields an epoch may not have.
OPTIONAL_SCALARS = {
    "epoch/val_accuracy": "val_accuracy",
    "epoch/val_loss": "val_loss",
    "epoch/val_top5": "val_top5",
    "epoch/ema_val_accuracy": "ema_val_accuracy",
    "epoch/ema_val_top5": "ema_val_top5",
    "epoch/ema_val_loss": "ema_val_loss",
    "rate/mfu": "mfu",
    "time/input_wait_fraction": "input_wait_fraction",
    "time/input_wait_fraction_worst": "input_wait_fraction_worst",
    "time/input_bound_fraction": "input_bound_fraction",
    "time/input_bound_fraction_worst": "input_bound_fraction_worst",
    "time/device_idle_fraction": "device_idle_fraction",
    "time/input_making_share": "input_making_share",
    "time/compile_seconds": "compile_seconds",
    "time/step_seconds": "step_seconds",
    "time/checkpoint_stall_seconds": "checkpoint_stall_seconds",
    "time/checkpoint_write_seconds": "checkpoint_write_seconds",
    "time/checkpoint_copy_seconds": "checkpoint_copy_seconds",
    "time/checkpoint_writer_wait_seconds": "checkpoint_writer_wait_seconds",
}


@dataclass(kw_only=True)
class EpochRecord:
    """One finished epoch: a metrics.jsonl line, and an entry of a checkpoint's "history".

    Sums and counts are over all replicas; *_seconds and wall_time are the
    reporting replica's. Fields left None are absent from the line: val_* in
    epochs without evaluation, setup_seconds after a process's first epoch,
    epoch_seconds and val_top5* in lines written before they existed, ema_* without ema.decay.
    """

    epoch: int
    wall_time: float  # time.time() at the epoch's end
    train_loss: float  # mean over the epoch's real samples
    train_samples: int  # real samples trained on (padding and bad data excluded)
    replica_steps: int  # steps of each replica
    train_seconds: float
    global_rate: float  # samples per second, summed over replicas
    train_filled: int  # real samples bad data took out (padding never counts)
    lr: float  # the learning rate of the epoch's last step
    # Where the training loop's time went (observe.timing), means over replicas: the host's
    # share spent waiting for a batch (and the worst replica's), seconds compiling, stepping, saving.
    input_wait_fraction: float | None = None
    input_wait_fraction_worst: float | None = None
    input_wait_seconds: float | None = None
    # The device's share idle between steps for want of input (and the worst replica's), and
    # idle between steps at all (observe.idle); absent where the runtime cannot see the device.
    input_bound_fraction: float | None = None
    input_bound_fraction_worst: float | None = None
    device_idle_fraction: float | None = None
    # Of the loader's waits for batches, the share before their last piece was made (observe.timing).
    input_making_share: float | None = None
    compile_seconds: float | None = None
    step_seconds: float | None = None
    # Saving: what the training loop waited, and the writing (checkpoint.asynchronous: in the
    # background, overlapped with training). Lines before 2026-11-27 had checkpoint_seconds (the stall).
    checkpoint_stall_seconds: float | None = None
    checkpoint_write_seconds: float | None = None
    # Of the stall: the state's copy to host memory, and the wait for the background writer's
    # previous save (observe.timing.Breakdown); absent in lines before 2026-11-28.
    checkpoint_copy_seconds: float | None = None
    checkpoint_writer_wait_seconds: float | None = None
    val_accuracy: float | None = None
    val_correct: int | None = None
    val_samples: int | None = None
    # Label among the 5 highest logits (all of them with fewer than 5 classes: 100%).
    val_top5: float | None = None
    val_top5_correct: int | None = None
    val_loss: float | None = None
    val_seconds: float | None = None
    val_filled: int | None = None
    # ema.decay: the weight average's evaluation on the same split.
    ema_val_accuracy: float | None = None
    ema_val_correct: int | None = None
    ema_val_top5: float | None = None
    ema_val_loss: float | None = None
    compilations: int  # graphs compiled in the process so far
    epoch_seconds: float | None = None  # training plus evaluation
    setup_seconds: float | None = None  # process start to its first loop
    # FLOPs to train on one sample (3 x forward, counted on the meta device; master only).
    model_flops_per_sample: int | None = None
    # Model FLOPs utilisation of the epoch's global rate against the TPU chips' bf16 peak.
    mfu: float | None = None
    # data.synthetic: trained on one device-resident batch, not data (no accuracy, no checkpoints).
    synthetic: bool | None = None
    # The process that ended the epoch (read `compilations`, evaluated), and the one whose loop
    # trained it (observe.timing.process_token): each process of a resumed run counts its
    # compilations from 0 and compiles its graphs once, which a reader must not take for
    # recompiling (observe.advice.process_epochs). They differ where a stop came between the
    # training and the evaluation. Drawn where the record is made; lines before 2026-11-28
    # have neither.
    process: str | None = field(default_factory=process_token)
    train_process: str | None = None

    @property
    def evaluated(self) -> bool:
        return self.val_accuracy is not None

    def to_dict(self) -> dict[str, Any]:
        """The metrics.jsonl line (before JSON), keys in the order the trainer has always stored them."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in values if value is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochRecord:
        """A record from a metrics.jsonl line or a history entry (keys a newer version added are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if "checkpoint_seconds" in data:  # written before the stall and the writing were apart
            data = {"checkpoint_stall_seconds": data["checkpoint_seconds"], **data}
        # A line read back names the process that wrote it, or none: never the reader's.
        data = {"process": None, **data}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"not an epoch record ({exc}): {dict(data)}") from None


def read_epoch_records(output_dir: str) -> list[EpochRecord]:
    """The records in a run folder's metrics.jsonl, in file order ([] if there is none yet)."""
    return [EpochRecord.from_dict(line) for line in checkpoint.read_metrics(output_dir)]


def time_shares(record: EpochRecord) -> str:
    """The epoch line's account of the loop: the device's idle shares where measured, the host's wait."""
    device = ""
    if record.input_bound_fraction is not None:
        device += (
            f"input-bound {100 * record.input_bound_fraction:.0f}%, worst replica "
            f"{100 * record.input_bound_fraction_worst:.0f}%; "
        )
    if record.device_idle_fraction is not None:
        device += f"device idle {100 * record.device_idle_fraction:.0f}%; "
    making = record.input_making_share
    making = "" if making is None else f" ({100 * making:.0f}% for batches not yet made)"
    return (
        f"{device}host wait {100 * record.input_wait_fraction:.0f}%{making}, worst replica "
        f"{100 * record.input_wait_fraction_worst:.0f}%; compile {record.compile_seconds:.1f}s, "
        f"step {record.step_seconds:.1f}s, checkpoints {record.checkpoint_stall_seconds:.1f}s"
        + (
            ""
            if record.checkpoint_write_seconds is None
            else f" + {record.checkpoint_write_seconds:.1f}s writing"
        )
    )


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


@dataclass(frozen=True)
class InputLayout:
    """How the training input is spread over this host, for the advice on workers (launch knows it)."""

    shards_per_replica: float | None = None  # the training split's shards per replica
    max_workers: int | None = None  # a replica's canonical streams, when the run has them
    local_replicas: int | None = None  # replica processes sharing this host's vCPUs


class EpochReporter:
    """One replica's log lines and, on the master, TensorBoard scalars and the run folder's files."""

    def __init__(
        self,
        cfg: TrainConfig,
        config_dict: dict[str, Any],
        runtime: Runtime,
        started_at: float | None = None,
        model_flops: int | None = None,
        input_layout: InputLayout | None = None,
    ):
        self.cfg = cfg
        self.model_flops = model_flops
        self.input_layout = input_layout or InputLayout()
        self.chip = chip_from_accelerator_type(runtime.accelerator_type())
        self.config_dict = config_dict
        self.runtime = runtime
        self.output_dir = cfg.output_dir
        self.device_name = f"{runtime.device.type}:{runtime.rank}/{runtime.world_size}"
        self.tensorboard: observe.TensorBoardLog | observe.NullTensorBoardLog = observe.NullTensorBoardLog()
        # Process start (train.py) to the first loop of this process, once.
        self.started_at = started_at
        self.setup_seconds: float | None = None

    def mark_setup_done(self) -> None:
        """Set-up ends where this process's first loop starts (what the epoch-time benchmark reads)."""
        if self.setup_seconds is None and self.started_at is not None:
            self.setup_seconds = time.time() - self.started_at

    def mfu(self, global_rate: float) -> float | None:
        """The model FLOPs utilisation of the whole job at global_rate samples/s (on a known TPU)."""
        if self.chip is None or not self.model_flops:
            return None
        devices = self.runtime.world_size * self.runtime.local_devices
        return mfu(self.model_flops, global_rate, devices, self.chip)

    def report_run_start(self, peak_lr: float, warmup_steps: int) -> None:
        """config.yaml, the model's FLOPs, and the learning rate linear scaling chose (master only)."""
        if not self.runtime.is_master:
            return
        self._write_run_file(checkpoint.write_config, self.config_dict)
        if self.model_flops:
            against = (
                f"; MFU against {self.chip.name}'s {self.chip.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip"
                if self.chip is not None
                else ""
            )
            log.info(
                "model: %.4g GFLOPs to train on one sample (3 x %.4g forward)%s",
                self.model_flops / 1e9,
                self.model_flops / TRAINING_FACTOR / 1e9,
                against,
            )
        if self.cfg.optim.reference_batch_size:
            log.info(
                "peak learning rate %.4g = %.4g x global batch %d / reference batch %d (linear scaling), "
                "after %d warmup steps",
                peak_lr,
                self.cfg.optim.lr,
                self.cfg.batch_size * self.runtime.world_size * self.runtime.local_devices,
                self.cfg.optim.reference_batch_size,
                warmup_steps,
            )

    def report_evaluation(self, epoch: int, metrics: Mapping[str, Any]) -> None:
        """eval_only: the checkpoint's evaluation (every replica)."""
        log.info(
            "evaluation of the checkpoint from epoch %d: accuracy=%.2f%% (%d/%d) top5=%.2f%% loss=%.4f",
            epoch,
            100 * metrics["val_accuracy"],
            metrics["val_correct"],
            metrics["val_samples"],
            100 * metrics["val_top5"],
            metrics["val_loss"],
        )
        if "ema_val_accuracy" in metrics:
            log.info(
                "its weight average (ema): accuracy=%.2f%% (%d/%d) top5=%.2f%% loss=%.4f",
                100 * metrics["ema_val_accuracy"],
                metrics["ema_val_correct"],
                metrics["val_samples"],
                100 * metrics["ema_val_top5"],
                metrics["ema_val_loss"],
            )

    def open(self, global_step: int) -> None:
        """Start the TensorBoard log (master only, with cfg.tensorboard)."""
        if not (self.runtime.is_master and self.cfg.tensorboard):
            return
        staging = os.path.join(self.cfg.log_dir, "tensorboard") if self.cfg.log_dir else None
        # A resumed run writes again the steps after its checkpoint's; TensorBoard
        # hides what the interrupted run wrote for them.
        self.tensorboard = observe.TensorBoardLog(
            self.output_dir, staging, purge_step=global_step + 1 if global_step else None
        )

    def close(self) -> None:
        self.tensorboard.close()

    def log_step(
        self, epoch: int, step: int, global_step: int, loss: torch.Tensor, tracker: RateTracker, lr: float
    ) -> None:
        """A training step's line and scalars; run as a step closure, once the step's loss is computed."""
        if not (self.runtime.is_master or log.isEnabledFor(logging.DEBUG)):
            return
        value, rate = loss.item(), tracker.rate()
        log.info(
            "Training Device=%s Epoch=%d Step=%d Loss=%.5f Rate=%.2f GlobalRate=%.2f",
            self.device_name,
            epoch,
            step,
            value,
            rate,
            tracker.global_rate(),
        )
        # The loss of the step that just ran, at the global step it finished.
        scalars = {"train/loss": value, "train/lr": lr, "train/rate_master": rate}
        self.tensorboard.scalars(global_step, scalars)

    def report_epoch(
        self,
        record: EpochRecord,
        best_accuracy: float,
        best_epoch: int,
        global_step: int,
        replica_rates: list[float],
    ) -> None:
        """The epoch's log line, and its TensorBoard scalars at the epoch's last global step."""
        train = (
            f"Epoch={record.epoch} train: loss={record.train_loss:.4f} samples={record.train_samples} "
            f"(replica steps {record.replica_steps}) skipped={record.train_filled} "
            f"GlobalRate={record.global_rate:.1f} time={record.train_seconds:.1f}s"
            + (f" MFU={100 * record.mfu:.1f}%" if record.mfu is not None else "")
            + (f" ({time_shares(record)})" if record.input_wait_fraction is not None else "")
        )
        top5 = f" top5={100 * record.val_top5:.2f}%" if record.val_top5 is not None else ""
        ema = (
            f" ema: accuracy={100 * record.ema_val_accuracy:.2f}% top5={100 * record.ema_val_top5:.2f}%"
            f" loss={record.ema_val_loss:.4f} |"
            if record.ema_val_accuracy is not None
            else ""
        )
        val = (
            f"val: accuracy={100 * record.val_accuracy:.2f}% ({record.val_correct}/"
            f"{record.val_samples}){top5} loss={record.val_loss:.4f} skipped={record.val_filled} |{ema} "
            f"best{'' if self.cfg.ema.select_best == 'raw' else ' ema'}={100 * best_accuracy:.2f}% "
            f"(epoch {best_epoch})"
            if record.evaluated
            else "val: none (data.synthetic)"
            if record.synthetic
            else "val: not this epoch (eval_every)"
        )
        # Every replica computes the same reduced numbers; one line per epoch is enough.
        (log.info if self.runtime.is_master else log.debug)("%s | %s", train, val)
        values = {
            "epoch/train_loss": record.train_loss,
            "epoch/lr": record.lr,
            "epoch/seconds": record.epoch_seconds,
            "rate/global": record.global_rate,
            "xla/compilations": record.compilations,
        }
        values.update({f"rate/replica_{rank:03d}": rate for rank, rate in enumerate(replica_rates)})
        # The record's fields an epoch may lack (no evaluation, no EMA, no TPU, older lines).
        for tag, name in OPTIONAL_SCALARS.items():
            if getattr(record, name) is not None:
                values[tag] = getattr(record, name)
        self.tensorboard.scalars(global_step, values)
        self.tensorboard.sync()

    def write_history(self, history: list[dict[str, Any]]) -> None:
        """metrics.jsonl, and after the first measured epoch and the last one what to change (master)."""
        if not self.runtime.is_master:
            return
        self._write_run_file(checkpoint.write_metrics, history)
        steady = [not (epoch.started or epoch.process_start) for epoch in process_epochs(history)]
        # After the first epoch no process started in (epoch 1 of a run never stopped): a
        # resumed process's first epochs carry its start, and the epochs before it were advised on.
        first_measured = steady[-1] and sum(steady) == 1
        if first_measured or history[-1]["epoch"] == self.cfg.epochs - 1:
            data, device = self.cfg.data, self.cfg.accelerator.device
            # A GPU run whose workers decode JPEG crops could leave the decoding to the GPU.
            gpu_could_decode = device == Device.CUDA and data.train_crop == TrainCrop.random_resized
            findings = advise(
                history,
                data.num_workers,
                usable_cpus(),
                self.input_layout.shards_per_replica,
                self.input_layout.max_workers,
                local_replicas=self.input_layout.local_replicas,
                gpu_could_decode=gpu_could_decode and data.decode == Decode.host,
                gpu_decodes=data.decode == Decode.device,
                saving=SavingSettings(self.cfg.checkpoint.every_n_steps, self.cfg.checkpoint.asynchronous),
            )
            for finding in findings:
                log.info("advice: %s", finding)

    def _write_run_file(self, writer: Callable[[str, Any], None], content: Any) -> None:
        """metrics.jsonl / config.yaml: useful, but never worth stopping a run for."""
        try:
            writer(self.output_dir, content)
        except StorageError as exc:
            log.warning("could not update the run folder (%s); the checkpoints hold the same data", exc)
