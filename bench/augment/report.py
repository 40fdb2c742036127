"""bench.augment's tables: the host's images/s and per-image costs, the device's step times and ratios."""

from __future__ import annotations

from bench.augment.device import PART_DRAWS
from bench.augment.host import implied_rate


def format_host(host: dict) -> str:
    """The pipeline off and on, the draws' cost, and the libraries' host RandAugment on the same crops."""
    rates = host["pipeline"]
    off = rates["off"]["samples_per_s"]
    lines = [
        "host: ours-local training crops (random-resized, 224), 0 workers = one core, batches of 128",
        f"  {'augment off':<52}{off:9.0f} images/s   {spread(rates['off'])}",
        f"  {'augment on (the draws added to each batch)':<52}{rates['on']['samples_per_s']:9.0f} images/s"
        f"   {spread(rates['on'])}, x{rates['on_over_off']:.3f} of off",
        "",
        f"  {'per image, on one core':<52}{'ms/image':>9}{'images/s':>10}"
        "   our pipeline with it added (implied)",
    ]
    for name, cost in host["draws"].items():
        lines.append(cost_line(f"our draws: {name}", cost, off))
    for name, cost in host["transforms"].items():
        lines.append(cost_line(name, cost, off))
    return "\n".join(lines)


def spread(rate: dict) -> str:
    low, high = rate["rounds_min_max"]
    return f"(rounds {low:.0f}-{high:.0f}, other load {rate['foreign_cores']:.2f} cores)"


def cost_line(name: str, cost: dict, pipeline_rate: float) -> str:
    rate = implied_rate(pipeline_rate, cost["ms_per_image"])
    return (
        f"  {name:<52}{cost['ms_per_image']:9.3f}{cost['images_per_s']:10.0f}"
        f"   {rate:6.0f} images/s (x{rate / pipeline_rate:.2f})"
    )


# (title, width, cell of a summary) of the device table's columns.
DEVICE_COLUMNS = (
    ("model", -24, lambda s: s["model"]),
    ("backend", -8, lambda s: s["backend"]),
    ("batch", 6, lambda s: str(s["batch_size"])),
    ("step off", 10, lambda s: f"{s['step']['off']['median_ms']:.0f}"),
    ("step on", 10, lambda s: f"{s['step']['on']['median_ms']:.0f}"),
    ("on/off", 8, lambda s: f"{s['ratio_on_over_off']:.3f}"),
    ("aug alone", 11, lambda s: f"{s['augment_ms_per_batch']:.1f}"),
    ("ms/image", 10, lambda s: f"{s['augment_ms_per_image']:.2f}"),
    ("of step", 9, lambda s: f"{100 * s['augment_share_of_step_off']:.1f}%"),
    (
        "recompiles",
        12,
        lambda s: "-" if s["compilations_after_warmup"] is None else str(s["compilations_after_warmup"]),
    ),
    ("graphs", 8, lambda s: "/".join("-" if g is None else str(g) for g in s["graphs_per_step"].values())),
    ("other load", 12, lambda s: f"{s['foreign_cores']:.2f}"),
)


def format_device(results: list[dict]) -> str:
    """A row per model and backend: step off and on (median ms), their ratio, the augmentation alone."""
    summaries = [result["summary"] for result in results]

    def row(cells: list[str]) -> str:
        return "  " + "".join(
            f"{cell:<{-width}}" if width < 0 else f"{cell:>{width}}"
            for cell, (_, width, _) in zip(cells, DEVICE_COLUMNS, strict=True)
        )

    lines = [
        "device: a training step (forward, backward, AdamW) at 224x224, median ms; graphs: per step off/on",
        row([title for title, _, _ in DEVICE_COLUMNS]),
        *(row([cell(s) for _, _, cell in DEVICE_COLUMNS]) for s in summaries),
    ]
    for s in summaries:
        if s["cpu_fallbacks"]:
            lines.append(
                f"  {s['model']}: ops run on the host while timing (no XLA lowering): {s['cpu_fallbacks']}"
            )
    lines += ["", "  the augmentation alone by part (median ms per batch, beyond the Normalizer's):"]
    for s in summaries:
        alone = s["augment_only"]
        normalize = alone["off"]["median_ms"]
        parts = ", ".join(f"{part} {alone[part]['median_ms'] - normalize:.1f}" for part in PART_DRAWS)
        total = s["augment_ms_per_batch"]
        lines.append(
            f"  {s['model']:<24}{s['backend']:<8}normalize {normalize:.1f}, all {total:.1f}: {parts}"
        )
    return "\n".join(lines)
