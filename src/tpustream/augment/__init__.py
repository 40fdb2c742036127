"""Augmentation on the device, inside the compiled train step (augment.*).

- ``draws``: the host side, every random draw per (seed, epoch, sample id),
  added to each training batch as small tensors (``BatchDraws``);
- ``mixing``: mixup and cutmix as masks and selection, with soft targets;
- ``erasing``: random erasing as masks;
- ``transform``: ``DeviceAugment``, the batch transform the trainer calls.

Shapes never depend on a draw, so the step compiles once whatever is drawn
(timm's Mixup on XLA tensors slices a box of the drawn size: a new graph for
each new size).
"""
