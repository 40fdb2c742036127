"""What "augmentation on" means in bench.augment, shared by the host side and the device children."""

from __future__ import annotations

from tpustream.config import AugmentConfig, EraseMode, MixMode

# timm's ImageNet recipe (DeiT / "ResNet strikes back" style): RandAugment, mixup
# and cutmix per element, random erasing with per-pixel noise.
RANDAUGMENT = "rand-m9-mstd0.5-inc1"
AUGMENT_ON = AugmentConfig(
    randaugment=RANDAUGMENT,
    mixup_alpha=0.8,
    cutmix_alpha=1.0,
    mix_mode=MixMode.elem,
    erase_prob=0.25,
    erase_mode=EraseMode.pixel,
)
# Each part of AUGMENT_ON alone, for the host draws' breakdown.
AUGMENT_PARTS = {
    "randaugment": AugmentConfig(randaugment=RANDAUGMENT),
    "mixup+cutmix": AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode=MixMode.elem),
    "erasing": AugmentConfig(erase_prob=0.25, erase_mode=EraseMode.pixel),
}
LABEL_SMOOTHING = 0.1  # on in both forms of the step, as timm's recipe has it
# timm's img_mean for ImageNet's mean: round(255 * (0.485, 0.456, 0.406)).
TIMM_IMG_MEAN = (124, 116, 104)
# timm's PosterizeIncreasing at magnitude 10 (m9 + noise reaches it) keeps 0 bits,
# which Pillow 13 refuses (ImageOps.posterize: "bits must be between or equal to 1
# and 8"); capping the magnitude just below keeps 1 bit, the same work, and changes
# no other operation's argument measurably.
TIMM_MAGNITUDE_MAX = 9.99
