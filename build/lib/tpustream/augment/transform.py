"""``DeviceAugment``: the training batch's augmentation on the device, as the trainer calls it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tpustream.augment.erasing import erase
from tpustream.augment.mixing import mix_images, mix_targets, partners, soft_target_cross_entropy
from tpustream.augment.ops import apply_layer
from tpustream.augment.policies import build_policy, policy_ops
from tpustream.config import AugmentConfig, Interpolation

# The batch fields the host's draws add (augment.draws.BatchDraws).
DRAW_KEYS = (
    "mix_lam", "mix_rest", "mix_cut", "mix_box", "erase_box", "erase_value",
    "erase_key", "aug_op", "aug_matrix", "aug_value", "aug_rest",
)  # fmt: skip


class DeviceAugment:
    """Operations, normalise, erase, then mix (timm's order: RandAugment on the 0..255 image,
    erasing on the normalised one, mixing across the batch).

    Takes a training batch with the host's draws; returns it with "input"
    (the model's normalised, augmented input) and, when mixing, what the loss
    needs for soft targets ("mix_label": each sample's partner's label,
    "mix_lam", "mix_rest"), the other draws taken out. Applied to the step's
    whole batch, before micro-batches cut it: pairs are a device's batch's.
    """

    def __init__(
        self,
        cfg: AugmentConfig,
        normalize: Callable[[torch.Tensor], torch.Tensor],
        label_smoothing: float,
        group: int,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
    ):
        self.cfg = cfg
        self.normalize = normalize
        self.label_smoothing = label_smoothing
        self.group = group
        policy = build_policy(cfg)
        self.codes = policy_ops(policy) if policy is not None else frozenset()
        # The geometric operations' fill: the config's, or timm's img_mean (the mean colour).
        self.fill = torch.tensor(
            list(cfg.fill) if cfg.fill is not None else [min(255, round(255 * m)) for m in mean],
            dtype=torch.float32,
        )

    def operations(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The policy's layers on the 0..255 images (float), each sample its own operations."""
        images = batch["image"].float()
        if images.shape[1] != len(self.fill):
            raise ValueError(f"augment.fill has {len(self.fill)} values for {images.shape[1]}-channel images")
        fill = self.fill.to(images.device)
        bilinear = self.cfg.interpolation == Interpolation.bilinear
        for layer in range(batch["aug_op"].shape[1]):
            images = apply_layer(
                images,
                batch["aug_op"][:, layer],
                batch["aug_matrix"][:, layer],
                batch["aug_value"][:, layer],
                batch["aug_rest"][:, layer],
                self.codes,
                bilinear,
                fill,
            )
        return images

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {key: value for key, value in batch.items() if key not in DRAW_KEYS}
        images = self.normalize(self.operations(batch) if "aug_op" in batch else batch["image"])
        if "erase_box" in batch:
            images = erase(images, batch["erase_box"], batch["erase_value"], batch.get("erase_key"))
        if "mix_lam" in batch:
            images = mix_images(images, batch, self.group)
            out.update(
                mix_label=partners(batch["label"], self.group),
                mix_lam=batch["mix_lam"],
                mix_rest=batch["mix_rest"],
            )
        out["input"] = images
        return out

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss: against the mixed soft targets when mixing, else (smoothed) cross-entropy."""
        if "mix_lam" not in batch:
            return F.cross_entropy(
                logits, batch["label"], reduction="none", label_smoothing=self.label_smoothing
            )
        targets = mix_targets(
            batch["label"],
            batch["mix_label"],
            batch["mix_lam"],
            batch["mix_rest"],
            logits.shape[1],
            self.label_smoothing,
        )
        return soft_target_cross_entropy(logits, targets)
