"""The input-pipeline benchmark's table and bar charts of samples/s, with each row's ratios."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

# (column title, row key) of the ratios a table and a chart show, e.g. ("x L", "x_L").
Ratios = Sequence[tuple[str, str]]


def row_label(row: dict) -> str:
    """The row's configuration name, with its mode (train / eval) where it has one."""
    return f"{row['name']} {row['mode']}" if row.get("mode") else row["name"]


def format_table(rows: list[dict], ratios: Ratios) -> str:
    width = max(20, max(len(row_label(r)) for r in rows) + 2)
    ratio_widths = [max(8, len(title) + 2) for title, _ in ratios]
    header = f"{'configuration':<{width}}{'workers':>8}{'samples/s':>11}"
    header += "".join(f"{title:>{w}}" for (title, _), w in zip(ratios, ratio_widths, strict=True))
    lines = [header + f"{'samples':>9}{'seconds':>9}{'passes':>7}{'other load':>12}"]
    for r in rows:
        workers = "-" if r["workers"] is None else str(r["workers"])
        line = f"{row_label(r):<{width}}{workers:>8}{r['samples_per_s']:>11.0f}"
        line += "".join(f"{r[key]:>{w}.2f}" for (_, key), w in zip(ratios, ratio_widths, strict=True))
        lines.append(
            line + f"{r['samples']:>9}{r['seconds']:>9.2f}{r['passes']:>7}{r['foreign_cores']:>12.2f}"
        )
    return "\n".join(lines)


def plot_bars(ax, rows: list[dict], ratios: Ratios, references: list[dict], worker_counts: Sequence[int]):
    """Horizontal samples/s bars, coloured by worker count, with dashed lines at the reference rows.

    Returns the legend handles.
    """
    from matplotlib.patches import Patch

    kinds = {None: ("tab:gray", "single-process limit"), 0: ("tab:blue", "num_workers=0")}
    kinds[max(worker_counts)] = ("tab:orange", f"num_workers={max(worker_counts)}")
    labels = [row_label(r) if r["workers"] is None else f"{row_label(r)} (w={r['workers']})" for r in rows]
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [r["samples_per_s"] for r in rows], color=[kinds[r["workers"]][0] for r in rows])
    for yi, r in zip(y, rows, strict=True):
        ratio_text = ", ".join(f"{r[key]:.2f}{title}" for title, key in ratios)
        ax.text(r["samples_per_s"], yi, f" {r['samples_per_s']:.0f}  ({ratio_text})", va="center", fontsize=8)
    handles = [Patch(color=color, label=label) for color, label in kinds.values()]
    for r, style in zip(references, (":", "--", "-."), strict=False):
        handles.append(
            ax.axvline(r["samples_per_s"], color="k", linestyle=style, linewidth=0.8, label=row_label(r))
        )
    ax.set_yticks(y, labels)
    ax.set_xlim(0, 1.4 * max(r["samples_per_s"] for r in rows))
    return handles


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(
    rows: list[dict],
    path: Path,
    title: str,
    ratios: Ratios,
    references: list[dict],
    worker_counts: Sequence[int],
) -> None:
    """One bar chart of every row's samples/s (see plot_bars), saved to path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(rows) + 1.6))
    handles = plot_bars(ax, rows, ratios, references, worker_counts)
    ax.set_xlabel("samples/s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
