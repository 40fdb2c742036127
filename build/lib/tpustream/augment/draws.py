"""The host side of augment.*: every random draw of a training batch, per (seed, epoch, sample id).

Each sample's draws come from a generator keyed by the run's seed, the epoch
and the sample's id, so a sample is augmented alike on any number of
replicas or workers and a resumed run draws what an uninterrupted one did.
Batch- and pair-level draws are those of the group's (pair's) first sample.
The draws travel with the batch as small tensors; the device applies them
(``mixing``, ``erasing``), so nothing drawn ever changes a shape.

The distributions are timm's: ``Mixup._params_per_elem`` / ``_params_per_batch``,
``cutmix_bbox_and_lam`` (with correct_lam) and ``RandomErasing._erase``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tpustream.augment.policies import RandAugment, TrivialAugment, build_policy
from tpustream.config import AugmentConfig, MixMode

# Keeps augmentation's generators apart from any other use of (seed, epoch, sample).
SALT = 0x6175676D  # "augm"
# RandomErasing's defaults (timm/data/random_erasing.py).
ERASE_AREA = (0.02, 1 / 3)
ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))
ERASE_ATTEMPTS = 10


def sample_generator(seed: int, epoch: int, sample_id: int, *stream: int) -> np.random.Generator:
    """The generator of one sample's draws (sample_id -1: a place filled after bad data).

    stream: another independent sequence for the same sample (the operation
    policy's, so turning mixing on or off leaves its draws as they were).
    """
    return np.random.default_rng([seed, SALT, epoch, sample_id + 1, *stream])


POLICY_STREAM = 1


class BatchDraws:
    """What the device needs to augment one batch: built once per stream, called per batch.

    group: the samples of one device's batch (the pairing and a batch-level
    draw stay inside it; under spmd a host's batch is several groups).
    """

    def __init__(self, cfg: AugmentConfig, image_hw: tuple[int, int], channels: int, group: int, seed: int):
        self.cfg = cfg
        self.height, self.width = image_hw
        self.channels = channels
        self.group = group
        self.seed = seed
        self.cutmix_alpha = 1.0 if cfg.cutmix_minmax is not None else cfg.cutmix_alpha
        self.policy: RandAugment | TrivialAugment | None = build_policy(cfg)

    def __call__(self, epoch: int, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        batch = len(sample_ids)
        generators = [sample_generator(self.seed, epoch, int(i)) for i in sample_ids]
        draws: dict[str, torch.Tensor] = {}
        if self.cfg.mixing():
            draws.update(self.mixing(generators))
        if self.cfg.erase_prob > 0:
            draws.update(self.erasing(generators))
        if self.policy is not None:
            draws.update(self.operations(epoch, sample_ids))
        assert all(t.shape[0] == batch for t in draws.values())
        return draws

    # -- mixup and cutmix -----------------------------------------------------
    def mix_params(self, rng: np.random.Generator) -> tuple[float, bool]:
        """(lambda, cutmix?) of one element or batch: timm's _params_per_elem for one."""
        cfg = self.cfg
        if rng.random() >= cfg.mix_prob:
            return 1.0, False
        if cfg.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cut = bool(rng.random() < cfg.switch_prob)
            alpha = self.cutmix_alpha if cut else cfg.mixup_alpha
        elif cfg.mixup_alpha > 0:
            cut, alpha = False, cfg.mixup_alpha
        else:
            cut, alpha = True, self.cutmix_alpha
        return float(rng.beta(alpha, alpha)), cut

    def cutmix_box(self, lam: float, rng: np.random.Generator) -> tuple[tuple[int, int, int, int], float]:
        """timm's cutmix_bbox_and_lam: (top, bottom, left, right) and lambda corrected to the box's area."""
        height, width = self.height, self.width
        if self.cfg.cutmix_minmax is not None:
            low, high = self.cfg.cutmix_minmax
            cut_h = int(rng.integers(int(height * low), int(height * high)))
            cut_w = int(rng.integers(int(width * low), int(width * high)))
            top, left = int(rng.integers(0, height - cut_h)), int(rng.integers(0, width - cut_w))
            box = (top, top + cut_h, left, left + cut_w)
        else:
            ratio = math.sqrt(1 - lam)
            cut_h, cut_w = int(height * ratio), int(width * ratio)
            cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
            box = (
                min(max(cy - cut_h // 2, 0), height),
                min(max(cy + cut_h // 2, 0), height),
                min(max(cx - cut_w // 2, 0), width),
                min(max(cx + cut_w // 2, 0), width),
            )
        area = (box[1] - box[0]) * (box[3] - box[2])
        return box, 1.0 - area / float(height * width)

    def mix_draw(self, rng: np.random.Generator) -> tuple[float, bool, tuple[int, int, int, int]]:
        """One element's (pair's, batch's) lambda for the target, whether it cuts, and its box (or none)."""
        value, is_cut = self.mix_params(rng)
        if value == 1.0 or not is_cut:
            return value, False, (0, 0, 0, 0)
        corners, value = self.cutmix_box(value, rng)
        return value, value != 1.0, corners

    def mixing(self, generators: list[np.random.Generator]) -> dict[str, torch.Tensor]:
        """mix_lam (the target's lambda), mix_rest (1 - it, in float64 first), mix_cut, mix_box."""
        batch = len(generators)
        lam = np.ones(batch, np.float64)
        cut = np.zeros(batch, bool)
        box = np.zeros((batch, 4), np.int32)
        mode = MixMode(self.cfg.mix_mode)
        for start in range(0, batch, self.group):
            size = min(self.group, batch - start)
            if mode == MixMode.batch:
                # The group's one draw, from its first sample's generator.
                value, is_cut, corners = self.mix_draw(generators[start])
                lam[start : start + size], cut[start : start + size] = value, is_cut
                box[start : start + size] = corners
                continue
            owners = range(size // 2) if mode == MixMode.pair else range(size)
            for offset in owners:
                value, is_cut, corners = self.mix_draw(generators[start + offset])
                places = [start + offset]
                if mode == MixMode.pair:
                    places.append(start + size - 1 - offset)
                for place in places:
                    lam[place], cut[place], box[place] = value, is_cut, corners
        return {
            "mix_lam": torch.from_numpy(lam.astype(np.float32)),
            "mix_rest": torch.from_numpy((1.0 - lam).astype(np.float32)),
            "mix_cut": torch.from_numpy(cut),
            "mix_box": torch.from_numpy(box),
        }

    # -- RandAugment / TrivialAugment -----------------------------------------
    def operations(self, epoch: int, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """aug_op (B, L) codes, aug_matrix (B, L, 6), aug_value and aug_rest (1 - value, in float64 first)."""
        policy = self.policy
        assert policy is not None
        batch, layers = len(sample_ids), policy.layers
        codes = np.zeros((batch, layers), np.int32)
        matrices = np.zeros((batch, layers, 6), np.float64)
        values = np.zeros((batch, layers), np.float64)
        for index, sample_id in enumerate(sample_ids):
            rng = sample_generator(self.seed, epoch, int(sample_id), POLICY_STREAM)
            for layer, drawn in enumerate(policy.draw(rng)):
                op = policy.to_device(drawn, self.height, self.width)
                codes[index, layer], matrices[index, layer], values[index, layer] = (
                    op.code,
                    op.matrix,
                    op.value,
                )
        return {
            "aug_op": torch.from_numpy(codes),
            "aug_matrix": torch.from_numpy(matrices.astype(np.float32)),
            "aug_value": torch.from_numpy(values.astype(np.float32)),
            "aug_rest": torch.from_numpy((1.0 - values).astype(np.float32)),
        }

    # -- random erasing -------------------------------------------------------
    def erasing(self, generators: list[np.random.Generator]) -> dict[str, torch.Tensor]:
        """erase_box (B, K, 4) top/bottom/left/right, empty where nothing is erased; erase_value (B, K, C);
        erase_key (B,) in pixel mode: the key the device hashes into the sample's noise."""
        count, batch = self.cfg.erase_count, len(generators)
        boxes = np.zeros((batch, count, 4), np.int32)
        values = np.zeros((batch, count, self.channels), np.float32)
        area = self.height * self.width
        for index, rng in enumerate(generators):
            if rng.random() >= self.cfg.erase_prob:
                continue
            # timm draws randint(1, count) rectangles when count > 1 (min_count 1).
            rectangles = 1 if count == 1 else int(rng.integers(1, count + 1))
            for k in range(rectangles):
                for _ in range(ERASE_ATTEMPTS):
                    target = rng.uniform(*ERASE_AREA) * area / rectangles
                    aspect = math.exp(rng.uniform(*ERASE_LOG_ASPECT))
                    h = int(round(math.sqrt(target * aspect)))
                    w = int(round(math.sqrt(target / aspect)))
                    if w < self.width and h < self.height:
                        top = int(rng.integers(0, self.height - h + 1))
                        left = int(rng.integers(0, self.width - w + 1))
                        boxes[index, k] = (top, top + h, left, left + w)
                        if self.cfg.erase_mode == "rand":
                            values[index, k] = rng.standard_normal(self.channels)
                        break
        draws = {"erase_box": torch.from_numpy(boxes), "erase_value": torch.from_numpy(values)}
        if self.cfg.erase_mode == "pixel":
            keys = [int(rng.integers(-(2**31), 2**31)) for rng in generators]
            draws["erase_key"] = torch.tensor(keys, dtype=torch.int32)
        return draws
