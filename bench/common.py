"""What the input-pipeline benchmarks share: pass timing, foreign-load accounting, gs:// opener, table, chart.

input_pipeline.py (CIFAR-like digits) and imagenet_pipeline.py (ImageNet-like
JPEGs) import it as a sibling module: `python bench/<script>.py` puts bench/
first on sys.path.
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import psutil
import torch
import torchvision
import webdataset as wds

from tpustream import storage
from tpustream.data.augment import Normalizer

Batch = tuple | list | dict
Epoch = Callable[[], Iterator[Batch]]  # each call starts one pass over the data
# (column title, row key) of the ratios a table and a chart show, e.g. ("x L", "x_L").
Ratios = Sequence[tuple[str, str]]


# ----------------------------------------------------------------------- timing


def batch_length(batch: Batch) -> int:
    return len(batch["label"]) if isinstance(batch, dict) else len(batch[1])


def timed_pass(epoch: Epoch) -> tuple[int, float]:
    """(samples after the first batch, seconds from the first batch to the last)."""
    batches = epoch()
    next(batches)  # start-up (workers, first shuffle buffer) ends here
    start = time.perf_counter()
    samples = sum(batch_length(batch) for batch in batches)
    return samples, time.perf_counter() - start


def measure(epoch: Epoch, min_seconds: float, warmup_batches: int | None = None) -> dict:
    """Timed passes until min_seconds are measured, after an untimed warm-up.

    The warm-up (page cache, lazy imports, emulator connections) is a whole
    pass, or its first warmup_batches batches where a pass is long: an
    abandoned pass shuts its DataLoader workers down, or, when they are
    persistent, the next pass resets them.
    """
    if warmup_batches is None:
        timed_pass(epoch)
    else:
        for _ in itertools.islice(epoch(), warmup_batches):
            pass
    samples, seconds, passes = 0, 0.0, 0
    while seconds < min_seconds:
        s, t = timed_pass(epoch)
        samples, seconds, passes = samples + s, seconds + t, passes + 1
    return {"samples": samples, "seconds": seconds, "passes": passes, "samples_per_s": samples / seconds}


class ForeignCpu:
    """Cores used by programs other than this benchmark while a configuration runs.

    The machine may be shared (other test runs), and with 2 cores any foreign
    load shows up in samples/s, so every row records it: system-wide busy CPU
    seconds minus those of this process, its reaped children (DataLoader
    workers, once shut down) and the GCS emulator, per wall second.
    """

    def __init__(self):
        self.emulators = [p for p in psutil.Process().children() if "fake-gcs" in p.name()]

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - t.iowait - t.guest - t.guest_nice  # guest time is also in user

    def _ours(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        return total + sum(sum(p.cpu_times()[:2]) for p in self.emulators)

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), self._busy(), self._ours()

    def __enter__(self) -> ForeignCpu:
        self.start = self._now()
        return self

    def __exit__(self, *exc_info) -> None:
        wall, busy, ours = (now - then for now, then in zip(self._now(), self.start, strict=True))
        self.cores = max(0.0, busy - ours) / wall


# ------------------------------------------------------------------- pipelines


def normalized(batches: Iterable[dict[str, torch.Tensor]], normalize: Normalizer) -> Iterator[Batch]:
    """uint8 batches to normalised float32, in the consuming process.

    ShardStream ships uint8 (a quarter of the bytes between processes and to
    the device) and the trainer normalises on the device inside the compiled
    step. Here the consumer does it on the host, so every configuration
    still pays for the same transforms.
    """
    for batch in batches:
        yield normalize(batch["image"]), batch["label"]


def gopen_via_tpustream(url: str, mode: str = "rb", bufsize: int = 8192, **kw):
    """A webdataset gopen handler (gopen_schemes entry) that streams gs:// in-process."""
    if mode != "rb":
        raise ValueError(f"{url}: only reading is supported, not mode {mode!r}")
    return storage.open_read(url)


def open_gs_in_process() -> None:
    """Make webdataset open gs:// URLs with tpustream.storage instead of `gsutil cat`.

    webdataset maps gs:// to a `gsutil cat` subprocess, and gsutil is not
    installed here. DataLoader workers are forked, so they inherit the entry.
    """
    sys.modules["webdataset.gopen"].gopen_schemes["gs"] = gopen_via_tpustream


def environment() -> dict:
    import PIL

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "webdataset": wds.__version__,
        "pillow": PIL.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------- report


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


def plot(
    rows: list[dict],
    path: Path,
    title: str,
    ratios: Ratios,
    references: list[dict],
    worker_counts: Sequence[int],
) -> None:
    """One bar chart of every row's samples/s (see plot_bars), saved to path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.38 * len(rows) + 1.6))
    handles = plot_bars(ax, rows, ratios, references, worker_counts)
    ax.set_xlabel("samples/s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
