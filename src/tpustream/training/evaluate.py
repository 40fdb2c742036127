"""Evaluation apart from the training loop: top-1, top-5 and loss over a whole split, exact over replicas."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpustream import progress
from tpustream.runtime import Runtime
from tpustream.training.debug import DebugChecks
from tpustream.training.epoch_checks import first_distinct
from tpustream.training.source import EpochSource
from tpustream.training.state import device_values


class Evaluator:
    """Top-1 and top-5 accuracy over the whole validation split, summed exactly over replicas.

    Built once per replica from the split's batches (as big_vision's
    evaluators, apart from the loop); the trainer runs it at epoch ends and
    for eval_only, and decides what a stop request means.
    """

    def __init__(
        self,
        runtime: Runtime,
        loader: EpochSource,
        normalize: Callable[[torch.Tensor], torch.Tensor],
        debug: DebugChecks,
    ):
        self.runtime = runtime
        self.loader = loader
        self.normalize = normalize
        self.debug = debug
        # The first shards with bad data in the last evaluation, over all replicas.
        self.bad_shards: list[str] = []

    @torch.no_grad()
    def run(
        self,
        model: nn.Module,
        epoch: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
        stop: Callable[[int], bool],
        first: bool,
        name: str = "model",
    ) -> dict[str, Any] | None:
        """The split's metrics; None if stop(index) said to stop after batch `index` (every replica alike).

        Padded places weigh zero (their "real" flag is 0), so every sample
        counts once whatever the world size. `first`: this process evaluates
        for the first time (its graph compiles). `name`: which weights (the
        model, or its average), for the collective's tag. Top-5 with fewer
        than 5 classes is top-(number of classes), so 100%.
        """
        model.eval()
        self.loader.set_epoch(epoch, skip_batches=0)
        # Top-1 hits, top-5 hits and real samples in one accumulator: one
        # reduction and one read to the host for all three, and no graph of
        # their own after the loop (a torch.cat there compiled once more).
        counts, loss_sum = device_values(self.runtime, ([0, 0, 0], torch.int32), (0.0, torch.float32))
        start = time.time()
        with self.debug.profiling_evaluation(epoch, name):
            for index, batch in enumerate(self.runtime.device_loader(self.loader)):
                with autocast():
                    logits = model(self.normalize(batch["image"]))
                real = batch["real"] > 0
                top1 = (logits.argmax(dim=1).eq(batch["label"]) & real).sum()
                # k is the logits' static width, so the graph is the same for every batch.
                top = logits.topk(min(5, logits.shape[1]), dim=1).indices
                top5 = (top.eq(batch["label"].unsqueeze(1)).any(dim=1) & real).sum()
                counts += torch.stack([top1, top5, real.sum()]).int()
                loss_sum += (
                    F.cross_entropy(logits.float(), batch["label"], reduction="none") * batch["real"]
                ).sum()
                progress.step_finished("an evaluation step")
                self.debug.watch_compiles("evaluation", index, first=first and index == 0)
                if stop(index):
                    return None
        self.loader.raise_if_incomplete("validation")
        counts, loss_sum = self.runtime.all_reduce_sum([counts, loss_sum])
        per_replica = self.runtime.all_gather_host(
            f"eval-{name}-epoch-{epoch}", (self.loader.filled, self.loader.bad_shards)
        )
        filled = sum(replica_filled for replica_filled, _ in per_replica)
        self.bad_shards = first_distinct(url for _, urls in per_replica for url in urls)
        correct, top5_correct, count = (int(value) for value in counts.tolist())
        return {
            "val_accuracy": correct / max(count, 1),
            "val_correct": correct,
            "val_samples": count,
            "val_top5": top5_correct / max(count, 1),
            "val_top5_correct": top5_correct,
            "val_loss": loss_sum.item() / max(count, 1),
            "val_seconds": time.time() - start,
            "val_filled": int(filled),
        }
