"""bench.feed's report: each row's rate against synthetic's and the best stock row's, as a markdown table."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.feed.rows import Row
from bench.harness import REPO

# The headline: tpustream at this share of data.synthetic's rate or more ...
GOAL_OF_SYNTHETIC = 0.95
# ... and this many times the stock pipeline's rate on the same shards.
GOAL_OF_STOCK = 1.7
VERSIONED = ("torch", "torchvision", "timm", "webdataset", "pillow", "simplejpeg", "numpy")


def reference_rates(rows: Sequence[Row]) -> tuple[float | None, float | None]:
    """(synthetic's rate, the fastest stock row's); None where no such row measured one.

    The fastest stock row: "N x stock" then holds against stock at its best worker count.
    """

    def rates(kind: str) -> list[float]:
        return [
            r.result["images_per_second"]
            for r in rows
            if r.input == kind and r.result.get("images_per_second")
        ]

    synthetic, stock = rates("synthetic"), rates("stock")
    return (max(synthetic) if synthetic else None, max(stock) if stock else None)


def ratio(rate: float | None, reference: float | None) -> float | None:
    return None if rate is None or not reference else rate / reference


def add_ratios(rows: Sequence[Row]) -> None:
    """of_synthetic and of_stock in every row's result."""
    synthetic, stock = reference_rates(rows)
    for row in rows:
        rate = row.result.get("images_per_second")
        row.result["of_synthetic"] = ratio(rate, synthetic)
        row.result["of_stock"] = ratio(rate, stock)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def times(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line a row, "-" where a number was not measured."""
    lines = [
        "| input | workers | images/s | of synthetic | of stock | input-bound | host wait | of it making "
        "| note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        result = row.result
        rate = result.get("images_per_second")
        cells = [
            row.name.partition(" w=")[0],  # "tpustream device": the input and how it decodes
            "-" if row.workers is None else str(row.workers),
            "-" if rate is None else f"{rate:,.1f}",
            times(result.get("of_synthetic"), ""),
            times(result.get("of_stock")),
            percent(result.get("input_bound_fraction")),
            percent(result.get("input_wait_fraction")),
            percent(result.get("input_making_share")),
            result.get("error", ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(rows: Sequence[Row]) -> dict[str, Any] | None:
    """The issue's two goals for the fastest tpustream row; None without one."""
    measured = [r for r in rows if r.input == "tpustream" and r.result.get("images_per_second")]
    if not measured:
        return None
    best = max(measured, key=lambda r: r.result["images_per_second"])
    of_synthetic, of_stock = best.result.get("of_synthetic"), best.result.get("of_stock")
    return {
        "row": best.name,
        "of_synthetic": of_synthetic,
        "of_synthetic_goal": GOAL_OF_SYNTHETIC,
        "of_synthetic_met": None if of_synthetic is None else of_synthetic >= GOAL_OF_SYNTHETIC,
        "of_stock": of_stock,
        "of_stock_goal": GOAL_OF_STOCK,
        "of_stock_met": None if of_stock is None else of_stock >= GOAL_OF_STOCK,
    }


def describe_goals(found: dict[str, Any] | None) -> str:
    if found is None:
        return "goals: no tpustream row measured a rate"

    def verdict(key: str) -> str:
        met = found[f"{key}_met"]
        return "not measured" if met is None else ("met" if met else "NOT met")

    return (
        f"goals ({found['row']}, the fastest tpustream row): "
        f"{times(found['of_synthetic'], '')} of synthetic (>= {found['of_synthetic_goal']}: "
        f"{verdict('of_synthetic')}), {times(found['of_stock'])} stock (>= {found['of_stock_goal']}x: "
        f"{verdict('of_stock')})"
    )


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The machine and the libraries; the GPU's name where there is one.

    Asking for the name starts CUDA in this process: a context held idle
    (under 1 GB) while the rows run in their own processes.
    """
    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        affinity = None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "cpu_count": os.cpu_count(),
        "sched_getaffinity": affinity,
        "threads_per_core": threads_per_core(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": {package: version(package) for package in VERSIONED} | {"torch": torch.__version__},
        "commit": commit.stdout.strip() if commit.returncode == 0 else None,
    }


def threads_per_core(cpu: int = 0) -> int | None:
    """Hardware threads sharing CPU `cpu`'s core (2 where vCPUs are hyperthreads); None where unknown.

    A training thread whose sibling runs a decoding worker runs slower than
    alone, which a synthetic run (no workers) never pays.
    """
    try:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return None
    return cpu_list_size(siblings)


def cpu_list_size(listing: str) -> int:
    """CPUs in a kernel CPU list: "0-1" -> 2, "0,8" -> 2, "3" -> 1."""
    count = 0
    for part in listing.strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def describe_environment(found: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {value}" for name, value in found["versions"].items() if value)
    return (
        f"{found['gpu'] or 'no GPU'}; os.cpu_count() {found['cpu_count']}, "
        f"sched_getaffinity {found['sched_getaffinity']}, "
        f"threads per core {found.get('threads_per_core') or '?'}; {versions}"
    )
