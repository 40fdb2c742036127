"""Mixup and cutmix on the device: masks and selection, static shapes, soft targets.

The same arithmetic as timm's Mixup (timm/data/mixup.py) for the same lambda
and box: mixup is ``x * lam + partner * (1 - lam)``, cutmix copies the
partner's box; the target is ``y * lam + y_partner * (1 - lam)`` with label
smoothing folded into both one-hot vectors (timm's mixup_target). Sample i's
partner is sample B-1-i of its own group (one device's batch), as timm's
``x.flip(0)`` within a process: under spmd no image crosses devices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def partners(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """Each group of `group` samples reversed: sample i's partner is B-1-i of its group."""
    return tensor.unflatten(0, (-1, group)).flip(1).flatten(0, 1)


def box_mask(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, 1, H, W) booleans: inside [top, bottom) x [left, right) of each sample's box."""
    rows = torch.arange(height, device=boxes.device).view(1, 1, height, 1)
    cols = torch.arange(width, device=boxes.device).view(1, 1, 1, width)
    top, bottom, left, right = (boxes[:, index].view(-1, 1, 1, 1) for index in range(4))
    return (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)


def mix_images(images: torch.Tensor, draws: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """Mixup where mix_cut is false (lam 1: unchanged), the partner's box where it is true."""
    other = partners(images, group)
    lam = draws["mix_lam"].view(-1, 1, 1, 1).to(images.dtype)
    rest = draws["mix_rest"].view(-1, 1, 1, 1).to(images.dtype)
    mixed = images * lam + other * rest
    inside = box_mask(draws["mix_box"], images.shape[-2], images.shape[-1])
    boxed = torch.where(inside, other, images)
    return torch.where(draws["mix_cut"].view(-1, 1, 1, 1), boxed, mixed)


def mix_targets(
    labels: torch.Tensor,
    partner_labels: torch.Tensor,
    lam: torch.Tensor,
    rest: torch.Tensor,
    num_classes: int,
    smoothing: float,
) -> torch.Tensor:
    """timm's mixup_target: smoothed one-hot targets, mixed with the partner's by lambda.

    The partners' labels come in whole (taken before micro-batches cut the
    batch); the class count is the logits' width.
    """
    off = smoothing / num_classes
    on = 1.0 - smoothing + off

    def smoothed(values: torch.Tensor) -> torch.Tensor:
        return F.one_hot(values, num_classes).float() * (on - off) + off

    return smoothed(labels) * lam.view(-1, 1) + smoothed(partner_labels) * rest.view(-1, 1)


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy against soft targets (timm's SoftTargetCrossEntropy, unreduced)."""
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1)
