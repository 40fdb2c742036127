"""The model's FLOPs per training sample, counted once on the meta device (no memory, no arithmetic).

torch.utils.flop_counter counts what the forward pass dispatches (convolutions,
matmuls, attention) and counts a multiply-add as two FLOPs, as MFU does:
torchvision's ResNet-50 at 224 is 4.09 G multiply-adds, 8.18 GFLOPs forward.
Training a sample costs about three forwards (the backward pass computes the
gradients of the activations and of the weights, each about one forward),
the convention of MFU (PaLM, Appendix B; torchprime).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

TRAINING_FACTOR = 3


def forward_flops_per_sample(
    build: Callable[[], nn.Module], shape: tuple[int, int, int], batch: int = 2
) -> int:
    """FLOPs of one sample's forward pass; build() makes the model (called under the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
        images = torch.empty(batch, *shape)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(images)
    return counter.get_total_flops() // batch


def training_flops_per_sample(build: Callable[[], nn.Module], shape: tuple[int, int, int]) -> int | None:
    """FLOPs to train on one sample: forward, backward and weight gradients (3 x forward).

    None, with a warning, if the count fails: a number for the report is never worth a run.
    """
    try:
        return TRAINING_FACTOR * forward_flops_per_sample(build, shape)
    except Exception as exc:
        log.warning("model FLOPs not counted (%s: %s); no MFU", exc.__class__.__name__, exc)
        return None
