"""PIL images of any mode to uint8 pixels of 1 or 3 channels (numpy and PIL only, no torch).

Shared by training's decoder (``decode``) and shard creation (``sources``),
which must not import torch: its worker processes would each pay for it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# PIL modes of 16-bit grey: PNG and TIFF give I;16 (I;16B big-endian TIFF),
# 16-bit PGM gives I (32-bit) holding 0..65535.
SIXTEEN_BIT_MODES = frozenset(("I;16", "I;16L", "I;16B", "I;16N", "I"))


def scale_16_to_8(values: np.ndarray) -> np.ndarray:
    """0..65535 to 0..255, rounded (v / 257): mid grey 32768 becomes 128, not clipped to white."""
    wide = np.clip(values.astype(np.int64, copy=False), 0, 65535)
    return ((wide + 128) // 257).astype(np.uint8)


def convert_pil_image(image: Image.Image, channels: int) -> np.ndarray:
    """A PIL image as uint8 (H, W) for channels=1 or (H, W, 3) for channels=3.

    Mode by mode:
    - L, RGB: as they are; to the other with PIL (L -> RGB repeats the grey,
      RGB -> L is ITU-R 601 luma).
    - P (palette): through its palette; with transparency it goes through
      RGBA first (PIL warns on a direct convert), and the alpha is dropped.
    - RGBA, LA, PA: the alpha is dropped, as PIL's convert does (no blending
      onto a background).
    - CMYK, YCbCr, HSV, LAB: PIL's conversion to RGB (then luma for 1 channel).
    - 1 (bilevel): 0 and 255.
    - I;16, I;16B, I;16L, I;16N (16-bit grey) and I (32-bit, as 16-bit PGM
      and TIFF give it): scaled from 0..65535 to 0..255 with rounding, values
      outside clipped; PIL's convert would clip everything above 255 to white.
    - F (32-bit float): PIL's convention, intensities on 0..255 (convert
      clips and truncates; NaN becomes 0).
    """
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES:
        grey = scale_16_to_8(np.asarray(image))
        return grey if channels == 1 else np.repeat(grey[:, :, None], 3, axis=2)
    target = "L" if channels == 1 else "RGB"
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode != target:
        try:
            image = image.convert(target)
        except ValueError:
            image = image.convert("RGB").convert(target)  # e.g. LAB: PIL converts it to RGB only
    return np.asarray(image)
