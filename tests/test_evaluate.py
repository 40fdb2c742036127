"""The Evaluator: top-1 and top-5 summed exactly over replicas, padding masked.

Replicas are threads on the plain CPU device (tests/fake_runtime.py). The
"images" are the logits themselves (an identity model), so which samples are
top-1 and top-5 correct is known in advance.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from tests.fake_runtime import FakeWorld, MemorySource, run_replicas
from tpustream.config import DebugConfig
from tpustream.training.debug import DebugChecks
from tpustream.training.evaluate import Evaluator


def logits_ranking_labels(ranks: list[int], classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in which sample i's label is the ranks[i]-th highest (0: the argmax), and the labels."""
    labels = torch.arange(len(ranks)) % classes
    logits = torch.empty(len(ranks), classes)
    for index, (label, rank) in enumerate(zip(labels.tolist(), ranks, strict=True)):
        order = [c for c in range(classes) if c != label]
        order.insert(rank, label)
        logits[index, order] = torch.arange(classes, 0, -1, dtype=torch.float32)
    return logits, labels


def evaluate(logits: torch.Tensor, labels: torch.Tensor, world_size: int, batch_size: int) -> list:
    """Every replica's (metrics, collectives) from one evaluation of the split."""

    def replica(runtime):
        loader = MemorySource(
            logits, labels, batch_size=batch_size, rank=runtime.rank, world_size=world_size, shuffle=False
        )
        evaluator = Evaluator(runtime, loader, lambda x: x, DebugChecks(DebugConfig(), runtime))
        metrics = evaluator.run(nn.Identity(), 0, contextlib.nullcontext, lambda index: False, first=True)
        return metrics, runtime.collectives

    results = run_replicas(FakeWorld(world_size), replica)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_top1_and_top5_are_exact_over_replicas_with_the_padding_masked():
    # Sample 0 is right at top-1: the padded place (a copy of it) would count if not masked.
    ranks = [0, 1, 4, 5, 9, 0, 3]
    logits, labels = logits_ranking_labels(ranks, classes=10)
    # 7 samples, 2 replicas of batch 2: 2 steps, the last place of replica 1 is padding.
    results = evaluate(logits, labels, world_size=2, batch_size=2)
    for metrics, collectives in results:
        assert (metrics["val_correct"], metrics["val_top5_correct"], metrics["val_samples"]) == (2, 5, 7)
        assert metrics["val_accuracy"] == pytest.approx(2 / 7)
        assert metrics["val_top5"] == pytest.approx(5 / 7)
        # Top-5 rides on the reduction top-1 already made: no collective added.
        assert collectives == ["all_reduce_sum", "all_gather_host:eval-model-epoch-0"]


def test_with_fewer_than_5_classes_top5_is_every_class():
    logits, labels = logits_ranking_labels([0, 1, 2, 2, 1], classes=3)
    ((metrics, _),) = evaluate(logits, labels, world_size=1, batch_size=2)
    assert (metrics["val_correct"], metrics["val_top5_correct"], metrics["val_samples"]) == (1, 5, 5)
    assert metrics["val_top5"] == 1.0
