"""The epoch-time report: runs.csv, table.md in the seed's layout, the plots, sweep.json."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.epoch_time.collect import HORIZONS, RunResult
from bench.epoch_time.plan import SWITCHES
from bench.epoch_time.run import STDERR_TAIL_LINES, STDOUT_TAIL_LINES


def format_duration(seconds: float) -> str:
    """12.3s, 4m 05s, 1h 02m, 2d 03h; 'n/a' for NaN."""
    if seconds is None or math.isnan(seconds):
        return "n/a"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    if round(seconds) < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes}m {rest:02d}s"
    if round(seconds / 60) < 24 * 60:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days}d {hours:02d}h"


def format_mean(mean: float, std: float) -> str:
    if math.isnan(std):
        return format_duration(mean)
    return f"{format_duration(mean)} ± {format_duration(std)}"


CSV_COLUMNS = [
    "name",
    "batch_size",
    *SWITCHES,
    "cache",
    "status",
    "epochs",
    "setup_s",
    "setup_method",
    "epoch1_s",
    "mean_s",
    "std_s",
    "epoch_time_method",
    "samples_per_s",
    "compilations",
    "compilations_epoch1",
    *(f"total_{n}_s" for n in HORIZONS),
    "process_s",
    "overhead_s",
    "cpu_s",
    "other_load_cores",
    "deserialize_failures",
    "epoch_seconds",
    "command",
]


def csv_value(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ";".join(f"{v:.3f}" for v in value)
    return str(value)


def csv_row(result: RunResult) -> dict[str, str]:
    spec = result.spec
    row: dict[str, Any] = {
        "name": spec.name,
        "batch_size": spec.batch_size,
        **{s: spec.setting(s) for s in SWITCHES},
        "cache": spec.cache,
        "status": "ok" if result.ok else f"failed: {result.error}",
        **{k: v for k, v in result.summary.items() if k in CSV_COLUMNS},
        "cpu_s": result.cpu_s,
        "other_load_cores": result.other_load,
        "deserialize_failures": result.deserialize_failures,
        "command": shlex.join(result.command),
    }
    return {column: csv_value(row.get(column)) for column in CSV_COLUMNS}


def write_csv(results: Iterable[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_row(r) for r in results)


TABLE_HEADER = ["configuration", "set-up", "epoch 1", "mean epoch (2+)", *(f"{n} epochs" for n in HORIZONS)]


def table_row(label: str, summary: dict[str, Any]) -> str:
    cells = [
        label,
        format_duration(summary["setup_s"]),
        format_duration(summary["epoch1_s"]),
        format_mean(summary["mean_s"], summary["std_s"]),
        *(format_duration(summary[f"total_{n}_s"]) for n in HORIZONS),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| " + " | ".join(TABLE_HEADER) + " |",
        "| --- | " + " | ".join("---:" for _ in TABLE_HEADER[1:]) + " |",
    ]
    for r in results:
        label = f"batch {r.spec.batch_size}, {r.spec.label}"
        if r.ok:
            lines.append(table_row(label, r.summary))
        else:
            lines.append(
                "| " + " | ".join([label, f"failed ({r.error})", *[""] * (len(TABLE_HEADER) - 2)]) + " |"
            )
    return "\n".join(lines)


def cache_table(results: Sequence[RunResult]) -> str:
    """Cold against warm compile cache, per batch size, from the runs with cache cold/warm."""
    pairs: dict[int, dict[str, RunResult]] = {}
    for r in results:
        if r.spec.cache in ("cold", "warm"):
            pairs.setdefault(r.spec.batch_size, {})[r.spec.cache] = r
    lines = [
        "| configuration | epoch 1, cold | epoch 1, warm | warm / cold | set-up, cold | set-up, warm "
        "| compilations cold / warm | cache entries unusable (warm) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch, pair in pairs.items():
        cold, warm = pair.get("cold"), pair.get("warm")
        if not (cold and warm and cold.ok and warm.ok):
            lines.append(f"| batch {batch}, baseline | failed | | | | | | |")
            continue
        c, w = cold.summary, warm.summary
        lines.append(
            f"| batch {batch}, baseline "
            f"| {format_duration(c['epoch1_s'])} | {format_duration(w['epoch1_s'])} "
            f"| {w['epoch1_s'] / c['epoch1_s']:.2f} | {format_duration(c['setup_s'])} "
            f"| {format_duration(w['setup_s'])} | {c['compilations']} / {w['compilations']} "
            f"| {warm.deserialize_failures} |"
        )
    return "\n".join(lines)


def failure_report(result: RunResult) -> str:
    lines = [
        f"run {result.spec.name} failed ({result.error})",
        f"  command: {shlex.join(result.command)}",
        f"  logs: {result.folder}/stdout.log, stderr.log",
    ]
    for stream, text, count in (
        ("stderr", result.stderr_tail, STDERR_TAIL_LINES),
        ("stdout", result.stdout_tail, STDOUT_TAIL_LINES),
    ):
        if text.strip():
            lines.append(f"  {stream} (last {count} lines):")
            lines.extend(f"    {line}" for line in text.splitlines())
        else:
            lines.append(f"  {stream}: empty")
    return "\n".join(lines)


def write_table(results: Sequence[RunResult], path: Path, title: str, notes: Sequence[str]) -> None:
    sweep = [r for r in results if r.spec.cache == "off"]
    cached = [r for r in results if r.spec.cache != "off"]
    out = io.StringIO()
    out.write(f"# {title}\n\n")
    for note in notes:
        out.write(f"{note}\n")
    out.write(
        "\nTotals for N epochs are the seed's projection: set-up + epoch 1 + mean epoch (2+) x (N - 1). "
        "Mean epoch: mean ± standard deviation over epochs 2+.\n\n"
    )
    out.write(markdown_table(sweep) + "\n")
    if cached:
        out.write("\n## Compile cache: the baseline twice with a fresh cache folder\n\n")
        out.write(cache_table(cached) + "\n")
    failed = [r for r in results if not r.ok]
    if failed:
        out.write("\n## Failed runs\n\n")
        for r in failed:
            out.write(f"```\n{failure_report(r)}\n```\n")
    path.write_text(out.getvalue())


def ratios(results: Sequence[RunResult], key: str = "mean_s") -> dict[str, dict[int, float]]:
    """switch -> batch size -> (run with only that switch flipped)[key] / baseline[key]."""
    base = {
        r.spec.batch_size: r for r in results if r.ok and r.spec.cache == "off" and r.spec.label == "baseline"
    }
    out: dict[str, dict[int, float]] = {}
    for r in results:
        if not r.ok or r.spec.cache != "off" or r.spec.batch_size not in base:
            continue
        flipped = [s for s, v in r.spec.settings if v != SWITCHES[s].baseline.name]
        if len(flipped) == 1:
            denominator = base[r.spec.batch_size].summary[key]
            out.setdefault(r.spec.label, {})[r.spec.batch_size] = r.summary[key] / denominator
    return out


def plot(results: Sequence[RunResult], folder: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    sweep = [r for r in results if r.ok and r.spec.cache == "off"]
    labels = list(dict.fromkeys(r.spec.label for r in sweep))
    batch_sizes = sorted({r.spec.batch_size for r in sweep})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, scale in zip(axes, ("linear", "log"), strict=True):
        for index, label in enumerate(labels):
            runs = sorted((r for r in sweep if r.spec.label == label), key=lambda r: r.spec.batch_size)
            x = [r.spec.batch_size for r in runs]
            color = colors[index % len(colors)]
            mean = [r.summary["mean_s"] for r in runs]
            std = [0.0 if math.isnan(r.summary["std_s"]) else r.summary["std_s"] for r in runs]
            ax.errorbar(
                x, mean, yerr=std, color=color, marker="o", capsize=3, label=f"{label}: mean epoch 2+"
            )
            ax.plot(
                x,
                [r.summary["epoch1_s"] for r in runs],
                color=color,
                marker="x",
                linestyle="--",
                alpha=0.6,
                label=f"{label}: epoch 1",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale(scale)
        if scale == "log":  # plain numbers, not 6x10^0
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (per replica)")
        ax.set_ylabel("seconds per epoch")
        ax.set_title(f"{scale} scale", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(folder / "epoch_time.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (key, what) in zip(axes, (("mean_s", "mean epoch 2+"), ("epoch1_s", "epoch 1")), strict=True):
        for label, by_batch in ratios(sweep, key).items():
            x = sorted(by_batch)
            color = colors[labels.index(label) % len(colors)]
            ax.plot(x, [by_batch[b] for b in x], marker="o", color=color, label=label)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (per replica)")
        ax.set_ylabel("switched / baseline")
        ax.set_title(f"{what} time, relative to the baseline", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(folder / "ratios.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def environment() -> dict[str, Any]:
    versions = {}
    for package in ("torch", "torch_xla", "hydra-core"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "python": platform.python_version(),
        **versions,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def setup_methods(results: Sequence[RunResult]) -> str:
    return ", ".join(sorted({r.summary["setup_method"] for r in results if r.summary})) or "n/a"


def epoch_methods(results: Sequence[RunResult]) -> str:
    return ", ".join(sorted({r.summary["epoch_time_method"] for r in results if r.summary})) or "n/a"


def write_report(
    results: Sequence[RunResult], out: Path, title: str, notes: Sequence[str], sweep: dict, plot_title: str
) -> int:
    """runs.csv, table.md, the plots and sweep.json in out; 1 if any run failed."""
    write_csv(results, out / "runs.csv")
    write_table(results, out / "table.md", title, notes)
    written = [out / "runs.csv", out / "table.md"]
    if any(r.ok and r.spec.cache == "off" for r in results):
        written += plot(results, out, f"{plot_title}, {os.cpu_count()} CPUs")
    (out / "sweep.json").write_text(json.dumps({**sweep, "environment": environment()}, indent=1) + "\n")
    written.append(out / "sweep.json")
    print((out / "table.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\n{len(failed)} of {len(results)} runs failed:", file=sys.stderr)
        for r in failed:
            print(failure_report(r), file=sys.stderr)
        return 1
    return 0
