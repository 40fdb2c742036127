"""RandAugment's and TrivialAugment's operations on the device: per-sample, by selection, static shapes.

Images are float tensors holding uint8 values (0..255) before normalisation,
as torchvision's tensor kernels (torchvision.transforms.v2.functional) see
them: every operation ends as theirs does on uint8 (clamped and truncated, or
rounded where they round), so the result is theirs within one grey level.
Each layer computes every operation the policy can draw for the whole batch
and selects per sample (``torch.where`` on the sample's code): on an
accelerator that is a few elementwise passes, and no draw changes the graph.
Geometric operations are one per-sample affine warp (gathers at the source
pixels), as torchvision's grid_sample with align_corners=False.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpustream.augment.policies import Op

MAX = 255.0
# torchvision's rgb_to_grayscale weights and adjust_sharpness's smoothing kernel.
GRAY = (0.2989, 0.587, 0.114)
SMOOTH_EDGE, SMOOTH_CENTRE = 1.0 / 13.0, 5.0 / 13.0


def per_sample(values: torch.Tensor) -> torch.Tensor:
    return values.view(-1, 1, 1, 1)


def grayscale(images: torch.Tensor) -> torch.Tensor:
    """rgb_to_grayscale without rounding, floored as adjust_saturation/contrast floor it for uint8."""
    r, g, b = images.unbind(dim=1)
    # torchvision's order of operations (a multiply-add per channel), so the floor falls alike.
    return r.mul(GRAY[0]).add(g, alpha=GRAY[1]).add(b, alpha=GRAY[2]).floor().unsqueeze(1)


def blend(images: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """torchvision's _blend on uint8: image * ratio + other * (1 - ratio), clamped, truncated."""
    return (images * per_sample(ratio) + other * per_sample(rest)).clamp(0, MAX).floor()


def sharpen(images: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """adjust_sharpness: the interior blended with its 3x3 smoothing (rounded); the border kept.

    The smoothing as nine shifted slices (elementwise work XLA fuses) rather than a depthwise convolution.
    """
    height, width = images.shape[-2:]
    inner = images[:, :, 1:-1, 1:-1]
    smooth = inner * SMOOTH_CENTRE
    for dy in range(3):
        for dx in range(3):
            if (dy, dx) != (1, 1):
                smooth = smooth + images[:, :, dy : dy + height - 2, dx : dx + width - 2] * SMOOTH_EDGE
    inner = inner + (smooth.round() - inner) * per_sample(rest)
    border = torch.ones(height, width, dtype=torch.bool, device=images.device)
    border[1:-1, 1:-1] = False
    return torch.where(border, images, F.pad(inner, (1, 1, 1, 1))).clamp(0, MAX).floor()


def autocontrast(images: torch.Tensor) -> torch.Tensor:
    """Each channel stretched to 0..255 (unchanged where it is flat)."""
    low = images.amin(dim=(-2, -1), keepdim=True)
    high = images.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, torch.ones_like(low), (high - low) * (1.0 / MAX))
    low = torch.where(flat, torch.zeros_like(low), low)
    return ((images - low) / inv_scale).clamp(0, MAX).floor()


def equalize(images: torch.Tensor) -> torch.Tensor:
    """torchvision's equalize (PIL's lookup table) per channel, with matrix products instead of a scatter.

    A pixel's level is 16 * high + low nibble: the 256-bin histogram is the
    product of the two 16-wide one-hot codings (a matmul, where a scatter-add
    serialises on a TPU and 256 comparisons per pixel cost 8 times the
    arithmetic), and the lookup is the same product with the table between.
    Exact even at a TPU's default (one bf16 pass) matmul precision: 0/1 and
    0..255 are bf16 numbers and the products accumulate in float32.
    """
    batch, channels, height, width = images.shape
    flat = images.reshape(batch * channels, height * width)
    nibbles = torch.arange(16, dtype=images.dtype, device=images.device)
    high_level = (flat * (1.0 / 16)).floor()
    high = (high_level.unsqueeze(-1) == nibbles).to(images.dtype)  # (N, HW, 16)
    low = ((flat - 16 * high_level).unsqueeze(-1) == nibbles).to(images.dtype)
    histogram = torch.bmm(high.transpose(1, 2), low).reshape(-1, 256).to(torch.int32)  # exact: 0/1 products
    cumulative = histogram.cumsum(dim=-1, dtype=torch.int32)
    # The pixels not at the channel's highest level, in steps of 255.
    top = cumulative.argmax(dim=-1, keepdim=True)
    step = torch.div(height * width - histogram.gather(-1, top), 255, rounding_mode="floor")
    half = torch.div(step, 2, rounding_mode="floor")
    lut = torch.div(cumulative[..., :-1] + half, step.clamp(min=1), rounding_mode="floor").clamp(0, 255)
    lut = F.pad(lut, (1, 0)).to(images.dtype).view(-1, 16, 16)
    equalized = (torch.bmm(high, lut) * low).sum(dim=-1)  # lut[high, low] per pixel
    equalized = torch.where(step != 0, equalized, flat)
    return equalized.view_as(images)


def warp(images: torch.Tensor, matrices: torch.Tensor, bilinear: bool, fill: torch.Tensor) -> torch.Tensor:
    """Per-sample affine warp: matrices (B, 6) map output to input pixels in centred coordinates.

    torchvision's _affine_grid and grid_sample(align_corners=False, zeros
    padding) with its fill handling, written as gathers so every sample has
    its own matrix; fill (C,) in 0..255.
    """
    batch, channels, height, width = images.shape
    dtype, device = images.dtype, images.device
    xs = torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width, dtype=dtype, device=device)
    ys = torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, height, dtype=dtype, device=device)
    theta = matrices.view(batch, 2, 3) / torch.tensor(
        [0.5 * width, 0.5 * height], dtype=dtype, device=device
    ).view(1, 2, 1)

    def source(row: torch.Tensor, size: int) -> torch.Tensor:
        grid = xs.view(1, 1, -1) * row[:, 0].view(-1, 1, 1) + ys.view(1, -1, 1) * row[:, 1].view(-1, 1, 1)
        grid = grid + row[:, 2].view(-1, 1, 1)
        return ((grid + 1) * size - 1) / 2  # grid_sample's unnormalisation

    px, py = source(theta[:, 0], width), source(theta[:, 1], height)  # (B, H, W)
    pixels = images.reshape(batch, channels, height * width)

    def tap(ix: torch.Tensor, iy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inside = (ix >= 0) & (ix <= width - 1) & (iy >= 0) & (iy <= height - 1)
        index = (iy.clamp(0, height - 1) * width + ix.clamp(0, width - 1)).long().view(batch, 1, -1)
        values = pixels.gather(2, index.expand(batch, channels, -1)).view(batch, channels, height, width)
        return values, inside.unsqueeze(1).to(dtype)

    fill = fill.to(dtype).view(1, -1, 1, 1)
    if not bilinear:
        values, inside = tap(px.round(), py.round())  # nearbyint: half to even, as torch.round
        return torch.where(inside > 0, values, fill)
    x0, y0 = px.floor(), py.floor()
    x1, y1 = x0 + 1, y0 + 1
    weights = (  # grid_sample's nw, ne, sw, se
        ((x1 - px) * (y1 - py), x0, y0),
        ((px - x0) * (y1 - py), x1, y0),
        ((x1 - px) * (py - y0), x0, y1),
        ((px - x0) * (py - y0), x1, y1),
    )
    total = torch.zeros_like(images)
    mask = torch.zeros_like(px).unsqueeze(1)
    for weight, ix, iy in weights:
        values, inside = tap(ix, iy)
        weight = weight.unsqueeze(1) * inside
        total = total + values * weight
        mask = mask + weight
    return ((total - fill) * mask + fill).round()


def apply_layer(
    images: torch.Tensor,
    op: torch.Tensor,
    matrix: torch.Tensor,
    value: torch.Tensor,
    rest: torch.Tensor,
    codes: frozenset[Op],
    bilinear: bool,
    fill: torch.Tensor,
) -> torch.Tensor:
    """One layer: each sample's operation (op (B,) codes; matrix (B, 6); value and rest = 1 - value (B,))."""
    chosen = per_sample(op)
    out = images

    def select(code: Op, result: torch.Tensor) -> None:
        nonlocal out
        out = torch.where(chosen == code, result, out)

    rgb = images.shape[1] == 3
    if Op.affine in codes:
        select(Op.affine, warp(images, matrix, bilinear, fill))
    if Op.brightness in codes:
        select(Op.brightness, (images * per_sample(value)).clamp(0, MAX).floor())
    if rgb and codes & {Op.color, Op.contrast}:
        gray = grayscale(images)
        if Op.color in codes:
            select(Op.color, blend(images, gray, value, rest))
        if Op.contrast in codes:
            select(Op.contrast, blend(images, gray.mean(dim=(1, 2, 3), keepdim=True), value, rest))
    elif Op.contrast in codes:  # one channel: its own mean (saturation leaves it as it is)
        select(Op.contrast, blend(images, images.mean(dim=(1, 2, 3), keepdim=True), value, rest))
    if Op.sharpness in codes and min(images.shape[-2:]) > 2:
        select(Op.sharpness, sharpen(images, rest))
    if Op.posterize in codes:
        step = per_sample(value)  # 2 ** (8 - bits), a power of two: the division is exact
        select(Op.posterize, (images / step).floor() * step)
    if Op.solarize in codes:
        select(Op.solarize, torch.where(images >= per_sample(value), MAX - images, images))
    if Op.solarize_add in codes:
        added = (images + per_sample(value)).clamp(max=MAX)
        select(Op.solarize_add, torch.where(images < 128, added, images))
    if Op.autocontrast in codes:
        select(Op.autocontrast, autocontrast(images))
    if Op.equalize in codes:
        select(Op.equalize, equalize(images))
    if Op.invert in codes:
        select(Op.invert, MAX - images)
    return out
