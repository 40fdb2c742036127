"""The train step's hooks: what one step does on the device with a batch, for the trainer to inherit.

One compiled step: the learning rate set, gradients zeroed, the batch
augmented on the device, the micro-batches' losses back-propagated (their
gradients add up), the optimizer run across replicas and the weight average
updated. Nothing here reads a value on the host. A strategy changes one
hook (``loss_denominator``, ``replica_samples``, ``run_optimizer`` in the
trainer, ...); the loop around it is ``trainer.Trainer``'s.

The hooks use what the trainer builds: cfg, runtime, model, optimizer,
schedule, normalize, augment, ema and the global step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tpustream.config import Precision
from tpustream.training.optim import set_learning_rate


class StepHooks:
    """The step and its hooks (``trainer.Trainer`` inherits them)."""

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
