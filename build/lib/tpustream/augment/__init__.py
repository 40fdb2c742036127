"""Augmentation on the device, inside the compiled train step (augment.*).

- ``draws``: the host side, every random draw per (seed, epoch, sample id),
  added to each training batch as small tensors (``BatchDraws``);
- ``policies``: RandAugment (timm's string) and TrivialAugmentWide, drawn per
  sample on the host as operation codes, affine matrices and values;
- ``ops``: their operations on the device, per sample by selection;
- ``mixing``: mixup and cutmix as masks and selection, with soft targets;
- ``erasing``: random erasing as masks (per-pixel noise hashed on the device);
- ``transform``: ``DeviceAugment``, the batch transform the trainer calls.

Shapes never depend on a draw, so the step compiles once whatever is drawn
(timm's Mixup on XLA tensors slices a box of the drawn size: a new graph for
each new size).
"""
